"""The id grammar (`contracts.ids`): one parser per record, total, and round trips."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rollart_hpc.contracts.ids import EpisodeId, RequestId
from rollart_hpc.routing.router import episode_of
from rollart_hpc.tasks.episodes import eval_round_of, is_eval_episode, is_greedy_episode, seed_key

versions = st.integers(0, 999_999)
indices = st.integers(0, 999_999)


@settings(max_examples=60, deadline=None)
@given(versions, st.booleans(), indices, st.integers(0, 500))
def test_evaluation_ids_round_trip_and_lose_only_their_round_in_the_seed(
    version: int, greedy: bool, index: int, turn: int
) -> None:
    episode = EpisodeId.evaluation(version, greedy, index)
    assert EpisodeId.parse(str(episode)) == episode
    assert (is_eval_episode(str(episode)), is_greedy_episode(str(episode))) == (True, greedy)
    assert eval_round_of(str(episode)) == version
    request = RequestId.of_turn(str(episode), turn)
    assert RequestId.parse(str(request)) == request and request.turn == turn
    assert episode_of(str(request)) == str(episode)
    other_round = RequestId.of_turn(str(EpisodeId.evaluation(version + 1, greedy, index)), turn)
    assert (
        seed_key(str(request))
        == seed_key(str(other_round))
        != seed_key(str(RequestId.of_turn(str(EpisodeId.evaluation(version, not greedy, index)), turn)))
    )


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="ascii"), max_size=30))
def test_any_text_parses_and_prints_back(text: str) -> None:
    assert str(RequestId.parse(text)) == text
    assert str(EpisodeId.parse(text)) == text
    if not text.startswith("eval-r"):
        assert seed_key(text) == text


def test_training_ids() -> None:
    episode = EpisodeId.train(42)
    assert str(episode) == "ep00000042" and EpisodeId.parse("ep00000042") == episode
    assert not is_eval_episode("ep00000042") and eval_round_of("ep00000042") is None
    assert EpisodeId.parse("e1").kind == "other"
