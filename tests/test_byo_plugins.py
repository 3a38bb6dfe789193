"""A run's own families, reward functions and task files: config, load-time checks, child processes."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

import pytest
from launching import usage_error_line

from rollart_hpc.config import load_config
from rollart_hpc.config.loader import build
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.reward.functions import reward_fn
from rollart_hpc.reward.main import make_scorer
from rollart_hpc.tasks.build import family_specs, heldout_tasks, own_family_rewards, run_tasks
from rollart_hpc.tasks.checks import check_own_code
from rollart_hpc.tasks.demos import run_oracle
from rollart_hpc.tasks.families.dataset import DatasetError, DatasetFamily, read_rows
from rollart_hpc.tasks.plugins import PluginError, load_object
from rollart_hpc.tasks.registry import BUILTIN_FAMILIES, FamilySpec
from rollart_hpc.tasks.rewards import ENV_WON, RewardInput

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
WORDLE = EXAMPLES / "wordle" / "config.toml"
JSONL = EXAMPLES / "jsonl_tasks" / "config.toml"


def _check(config: Config) -> list[str]:
    return check_own_code(config.envs, config.reward, config.run.python_path)


def test_import_paths_fail_in_one_line_naming_what_is_wrong():
    with pytest.raises(PluginError, match=r"not an import path"):
        load_object("my_pkg.missing")
    with pytest.raises(PluginError, match=r"cannot import 'my_pkg_missing_xyz': ModuleNotFoundError"):
        load_object("my_pkg_missing_xyz:make_family")
    with pytest.raises(PluginError, match=r"'json' has no attribute 'nope'"):
        load_object("json:nope")
    assert load_object("json:dumps") is json.dumps


@pytest.mark.parametrize("command", [["run"], ["submit", "--dry-run"]])
def test_missing_factory_exits_2_with_one_line_naming_key_and_path(tmp_path, command):
    line = usage_error_line(
        *command,
        WORDLE,
        "envs.plugins=[{name='wordle', factory='my_pkg.missing:make_family'}]",
        "--run-dir",
        tmp_path / "run",
    )
    assert "envs.plugins[0].factory" in line, line
    assert "my_pkg.missing:make_family" in line and "No module named 'my_pkg'" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "envs.plugins=[{name='wordle', factory='wordle_game:WORDS'}]",
            r"envs\.plugins\[0\]\.factory: 'wordle_game:WORDS' names a tuple, not a callable",
        ),
        (
            "envs.plugins=[{name='wordle', factory='wordle_game:WordleEnv'}]",
            r"envs\.plugins\[0\]\.factory: 'wordle_game:WordleEnv' made a WordleEnv without tasks, heldout_tasks",
        ),
        (
            "envs.plugins=[{name='wordle', factory='wordle_game:make_family', options={num_words=99}}]",
            r"envs\.plugins\[0\]\.options: wordle_game:make_family\(\*\*options\) raised ValueError: num_words",
        ),
        (
            "reward.functions={wordle='wordle_game:nope'}",
            r"reward\.functions\.wordle: .*has no attribute 'nope'",
        ),
        (
            "reward.functions={wordle='wordle_game:feedback'}",
            r"reward\.functions\.wordle: 'wordle_game:feedback' does not take one argument",
        ),
    ],
)
def test_protocol_violations_are_one_line_usage_errors(override, message):
    config = load_config(WORDLE, [override])
    with pytest.raises(UsageError, match=message) as info:
        _check(config)
    assert "\n" not in str(info.value)


def test_a_family_named_otherwise_or_with_foreign_tasks_is_refused(tmp_path):
    (tmp_path / "other_fam.py").write_text(
        "from wordle_game import WordleFamily\n"
        "class Renamed(WordleFamily):\n    name = 'other'\n"
        "def make(**options):\n    return Renamed(**options)\n"
    )
    plugins = "envs.plugins=[{name='wordle', factory='other_fam:make'}]"
    bad = load_config(WORDLE, [f"run.python_path=['.', '{tmp_path}']", plugins])
    assert bad.run.python_path == [str(WORDLE.parent), str(tmp_path)]
    with pytest.raises(
        UsageError, match=r"made a Renamed named 'other', not 'wordle' \(envs\.plugins\[0\]\.name\)"
    ):
        _check(bad)


@pytest.mark.parametrize(
    ("envs", "message"),
    [
        (
            {"families": ["wordle"]},
            r"envs\.families: 'wordle' is not one of 'household'.* nor a name of envs\.plugins",
        ),
        (
            {"families": ["calc_math"], "plugins": [{"name": "w", "factory": "a:b"}]},
            r"envs\.plugins\[0\]\.name: 'w' is not in envs\.families \(it would have no effect\)",
        ),
        (
            {"families": ["calc_math"], "plugins": [{"name": "calc_math", "factory": "a:b"}]},
            r"envs\.plugins\[0\]\.name: 'calc_math' must be a new family name",
        ),
        (
            {"families": ["w"], "plugins": [{"name": "w", "factory": "a.b"}]},
            r"envs\.plugins\[0\]\.factory: 'a\.b'",
        ),
        (
            {"families": ["d"], "datasets": [{"name": "d", "path": "x.parquet"}]},
            r"envs\.datasets\[0\]\.path: reading \.parquet needs the pyarrow package",
        ),
        (
            {"families": ["d"], "datasets": [{"name": "d", "path": "x.csv"}]},
            r"must end in \.jsonl or \.parquet",
        ),
        (
            {
                "families": ["d"],
                "datasets": [{"name": "d", "path": "x.jsonl", "split_field": "s", "heldout_fraction": 0.1}],
            },
            r"envs\.datasets\[0\]\.heldout_fraction: set split_field or heldout_fraction, not both",
        ),
    ],
)
def test_config_errors_name_the_dotted_key(envs, message, monkeypatch):
    if "pyarrow" in message:  # pyarrow is a dependency: an environment without it, as find_spec sees it
        _without_pyarrow(monkeypatch)
    with pytest.raises(UsageError, match=message):
        build(Config, {"envs": envs})


def _without_pyarrow(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a)
    )


def test_parquet_datasets_pass_the_config_check_with_pyarrow(monkeypatch):
    config = build(Config, {"envs": {"families": ["d"], "datasets": [{"name": "d", "path": "x.parquet"}]}})
    assert config.envs.datasets[0].path == "x.parquet"
    _without_pyarrow(monkeypatch)
    with pytest.raises(UsageError, match=r"needs the pyarrow package, which is not installed$"):
        build(Config, {"envs": {"families": ["d"], "datasets": [{"name": "d", "path": "x.parquet"}]}})


def test_cross_section_checks_of_reward_functions_and_python_path():
    with pytest.raises(UsageError, match=r"reward\.functions\.wordle: family not in envs\.families"):
        build(Config, {"reward": {"functions": {"wordle": "a:b"}}})
    with pytest.raises(
        UsageError, match=r"run\.python_path: set only with envs\.plugins, reward\.functions or envs\.agent"
    ):
        build(Config, {"run": {"python_path": ["."]}})


def test_plugin_family_builds_in_a_spawned_child_from_its_spec():
    config = load_config(WORDLE)
    spec = family_specs(config.envs, config.run.python_path)["wordle"]
    assert spec.factory == "wordle_game:make_family" and spec.python_path == (str(WORDLE.parent),)
    assert hash(spec) == hash(FamilySpec(spec.name, spec.options, spec.factory, spec.python_path))
    ctx = mp.get_context("spawn")  # a fresh interpreter: nothing of this process's sys.path edits
    with ctx.Pool(1) as pool:
        won = pool.apply(_play_oracle, (spec, "wordle/3"))
    assert won


def _play_oracle(spec: FamilySpec, task_id: str) -> bool:
    return run_oracle(spec.build(), task_id).won


def test_wordle_family_tasks_oracle_and_reward():
    config = load_config(WORDLE)
    assert _check(config) == []
    tasks = run_tasks(config.envs)
    assert [t.id for t in tasks][:2] == ["wordle/0", "wordle/1"] and len(tasks) == 12
    assert own_family_rewards(config.envs) == {"wordle": ENV_WON}
    score = reward_fn(config.reward.functions["wordle"], config.run.python_path)
    from wordle_game import secret

    word = secret("wordle/5")
    assert score(RewardInput("wordle/5", "wordle", (f"<guess>{word}</guess>",), 1.0, True)).success
    miss = score(RewardInput("wordle/5", "wordle", ("<guess>zzzzz</guess>",), 0.0, False))
    assert not miss.success and miss.reward == pytest.approx(0.1 * sum(c == "z" for c in word))


def test_builtin_families_register_through_the_same_surface():
    for name, entry in BUILTIN_FAMILIES.items():
        family = load_object(entry.factory)
        assert callable(family) and callable(load_object(entry.reward)), name


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_dataset_rows_count_and_name_the_malformed_ones(tmp_path):
    path = _write(
        tmp_path / "t.jsonl",
        [
            json.dumps({"q": "2+2?", "a": 4}),
            "not json",
            json.dumps({"q": "capital of France?", "a": "Paris", "s": "test"}),
            json.dumps({"q": "", "a": 1}),
            "",
            json.dumps([1, 2]),
            json.dumps({"q": "x?", "a": True}),
        ],
    )
    rows = read_rows(str(path), "q", "a")
    assert [r.number for r in rows.rows] == [1, 3]
    assert [n for n, _ in rows.malformed] == [2, 4, 6, 7]
    summary = rows.summary("mine")
    assert summary.startswith(
        "dataset mine: 2 tasks (2 train, 0 held-out), 4 malformed rows skipped (row 2: not JSON"
    )
    split = read_rows(str(path), "q", "a", "s")
    assert [(r.number, r.heldout) for r in split.rows] == [(3, True)]
    assert "row 1: 's' is None, not 'train', 'test' or 'heldout'" in split.summary("mine")


def _parquet(path: Path, columns: dict[str, tuple[list, str]]) -> Path:
    """A parquet file of typed columns: name -> (values, arrow type name)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_()}
    arrays = {n: pa.array(v, type=types.get(t) or pa.list_(pa.int64())) for n, (v, t) in columns.items()}
    pq.write_table(pa.table(arrays), path)
    return path


def test_parquet_rows_load_as_the_same_jsonl_rows_with_the_malformed_ones_named(tmp_path):
    """The same rows as a .parquet file and as .jsonl: the same tasks, the same malformed rows and reasons
    (a null is a missing field), the same summary line; the family's task ids are the row numbers."""
    q = ["2+2?", None, "capital of France?", "", "  ", "x?", "y?", "z?"]
    a = ["4", "1", "Paris", "1", "2", None, " ", "7"]
    sp = ["train", "train", "test", "train", "train", "train", "train", "dev"]
    pq_path = _parquet(tmp_path / "t.parquet", {"q": (q, "string"), "a": (a, "string"), "s": (sp, "string")})
    records = [{"q": x, "a": y, "s": z} for x, y, z in zip(q, a, sp, strict=True)]
    jsonl = _write(tmp_path / "t.jsonl", [json.dumps(r) for r in records])
    for split in ("", "s"):
        got, want = read_rows(str(pq_path), "q", "a", split), read_rows(str(jsonl), "q", "a", split)
        assert got == want and got.summary("mine") == want.summary("mine")
    rows = read_rows(str(pq_path), "q", "a", "s")
    assert [(r.number, r.heldout) for r in rows.rows] == [(1, False), (3, True)]
    assert [n for n, _ in rows.malformed] == [2, 4, 5, 6, 7, 8]
    assert rows.summary("mine").startswith(
        "dataset mine: 2 tasks (1 train, 1 held-out), 6 malformed rows skipped (row 2: no text under 'q'"
    )
    assert "row 6: no number or text under 'a'" in rows.summary("mine")
    family = DatasetFamily("mine", str(pq_path), "q", "a", "s")
    assert [t.id for t in family.tasks()] == ["mine/1"]
    assert [t.prompt for t in family.heldout_tasks(5)] == ["capital of France?"]


def test_parquet_columns_of_the_wrong_type_are_malformed_rows(tmp_path):
    """Numbers are answers (an int64 or float64 column, nulls missing); a bool or list answer column, or a
    prompt column that is not text, makes every row malformed: a file with no good row is an error."""
    prompts = (["a?", "b?", "c?"], "string")
    numbers = _parquet(tmp_path / "n.parquet", {"q": prompts, "a": ([4, None, 7], "int64")})
    rows = read_rows(str(numbers), "q", "a")
    assert [(r.number, r.answer) for r in rows.rows] == [(1, "4"), (3, "7")]
    assert rows.malformed == ((2, "no number or text under 'a'"),)
    floats = _parquet(tmp_path / "f.parquet", {"q": prompts, "a": ([2.5, 1.0, None], "float64")})
    assert [r.answer for r in read_rows(str(floats), "q", "a").rows] == ["2.5", "1.0"]
    for name, columns, reason in [
        ("bool", {"q": prompts, "a": ([True, False, True], "bool")}, "no number or text under 'a'"),
        ("list", {"q": prompts, "a": ([[1], [2], []], "list")}, "no number or text under 'a'"),
        ("int", {"q": ([1, 2, 3], "int64"), "a": (["1", "2", "3"], "string")}, "no text under 'q'"),
        ("absent", {"prompt": prompts, "a": (["1", "2", "3"], "string")}, "no text under 'q'"),
    ]:
        error = rf"holds no good row \(3 malformed; row 1: {reason}\)"
        with pytest.raises(DatasetError, match=error):
            read_rows(str(_parquet(tmp_path / f"{name}.parquet", columns)), "q", "a")
        twin = [
            json.dumps(dict(zip(columns, r, strict=True)))
            for r in zip(*(v for v, _ in columns.values()), strict=True)
        ]
        with pytest.raises(DatasetError, match=error):  # the same rows as JSONL: the same error
            read_rows(str(_write(tmp_path / f"{name}.jsonl", twin)), "q", "a")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not a parquet file at all")
    with pytest.raises(DatasetError, match=r"cannot read .*broken\.parquet: .*[Pp]arquet"):
        read_rows(str(broken), "q", "a")


def test_parquet_dataset_config_loads_the_same_tasks_as_its_jsonl_twin(tmp_path):
    """A run config naming a .parquet file: the config check's summary and the run's tasks equal those of
    the same rows as .jsonl (the example's rows that are JSON objects, answers as text)."""
    records = []
    for line in (JSONL.parent / "tasks.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    fields = ("question", "answer", "split")
    columns = {f: ([None if r.get(f) is None else str(r[f]) for r in records], "string") for f in fields}
    _parquet(tmp_path / "tasks.parquet", columns)
    _write(
        tmp_path / "tasks.jsonl",
        [json.dumps({f: columns[f][0][i] for f in fields}) for i in range(len(records))],
    )
    summaries, tasks = [], []
    for suffix in ("parquet", "jsonl"):
        dataset = f"{{name='trivia', path='{tmp_path / ('tasks.' + suffix)}', prompt_field='question', split_field='split'}}"
        config = load_config(JSONL, [f"envs.datasets=[{dataset}]"])
        summaries.append(_check(config))
        tasks.append([(t.id, t.prompt) for t in run_tasks(config.envs)])
    assert summaries[0] == summaries[1] and tasks[0] == tasks[1]
    assert summaries[0][0].startswith("dataset trivia: 18 tasks (14 train, 4 held-out), 1 malformed row")
    assert len(tasks[0]) == 14


def test_dataset_family_checks_answers_with_the_calc_math_checker(tmp_path):
    path = _write(
        tmp_path / "t.jsonl",
        [json.dumps({"prompt": f"q{i}", "answer": ans}) for i, ans in enumerate(["1,000", "Paris", "2.5"])],
    )
    family = DatasetFamily("mine", str(path))
    assert [t.id for t in family.tasks()] == ["mine/1", "mine/2", "mine/3"]
    env = family.make_env()
    for tid, reply, won in [
        ("mine/1", "<answer>1000</answer>", True),
        ("mine/2", "<answer> paris </answer>", True),
        ("mine/3", "<answer>2.4</answer>", False),
        ("mine/3", "2.5", False),
    ]:
        assert env.reset(tid) == family.task(tid).prompt
        _, reward, done, info = env.step(reply)
        assert done and info["won"] is won and reward == float(won)
    assert all(run_oracle(family, t.id).won for t in family.tasks())


def test_dataset_heldout_fraction_is_stable_and_disjoint(tmp_path):
    path = _write(
        tmp_path / "t.jsonl", [json.dumps({"prompt": f"question {i}", "answer": i}) for i in range(200)]
    )
    family = DatasetFamily("mine", str(path), heldout_fraction=0.2)
    train, held = {t.id for t in family.tasks()}, {t.id for t in family.heldout_tasks(1000)}
    assert not train & held and len(train) + len(held) == 200 and 20 < len(held) < 60
    grown = _write(
        tmp_path / "u.jsonl", [*path.read_text().splitlines(), json.dumps({"prompt": "new", "answer": 1})]
    )
    assert held <= {t.id for t in DatasetFamily("mine", str(grown), heldout_fraction=0.2).heldout_tasks(1000)}


def test_jsonl_example_loads_with_its_summary_and_split():
    config = load_config(JSONL)
    assert config.envs.datasets[0].path == str(JSONL.parent / "tasks.jsonl")
    (summary,) = _check(config)
    assert summary.startswith("dataset trivia: 18 tasks (14 train, 4 held-out), 2 malformed rows skipped")
    assert len(run_tasks(config.envs)) == 14
    held = heldout_tasks(build(Config, {"envs": {**_envs_dict(config), "num_heldout": {"trivia": 3}}}).envs)
    assert len(held) == 3


def _envs_dict(config: Config) -> dict:
    from rollart_hpc.config.loader import to_dict

    return to_dict(config.envs)


def test_missing_dataset_file_is_a_usage_error(tmp_path):
    config = load_config(JSONL, [f"envs.datasets=[{{name='trivia', path='{tmp_path / 'none.jsonl'}'}}]"])
    with pytest.raises(UsageError, match=r"envs\.datasets\[0\]\.path: cannot read .*none\.jsonl"):
        _check(config)


def test_reward_service_refuses_a_bad_reward_function_in_one_line(tmp_path):
    line = usage_error_line(
        "reward-service",
        WORDLE,
        "reward.functions={wordle='wordle_game:missing'}",
        "--run-dir",
        tmp_path / "service",
    )
    assert "reward.functions.wordle: 'wordle_game:missing'" in line, line


def test_num_heldout_of_an_own_family_is_any_count_from_zero():
    envs = {"families": ["w"], "plugins": [{"name": "w", "factory": "a:b"}]}
    assert build(Config, {"envs": {**envs, "num_heldout": {"w": 40}}}).envs.heldout_count("w") == 40
    with pytest.raises(UsageError, match=r"envs\.num_heldout\.w: must be >= 0, got -1"):
        build(Config, {"envs": {**envs, "num_heldout": {"w": -1}}})


def test_reward_rank_scores_own_families_in_worker_processes(tmp_path):
    config = load_config(WORDLE, ["reward.executor='process'", "reward.max_workers=1"])
    secret = load_object("wordle_game:secret", config.run.python_path)
    pool = make_scorer(config, 3, tmp_path)
    assert pool.cfg.fn_for_family == {"wordle": "wordle_game:score"}
    word = secret("wordle/2")
    inputs = [
        RewardInput("wordle/2", "wordle", (f"<guess>{word}</guess>",), 0.0, False),
        RewardInput("wordle/2", "wordle", (f"<guess>{word[:4]}z</guess>",), 0.0, False),
    ]

    async def score_all() -> list:
        return [await pool.score_input(inp) for inp in inputs]

    try:
        outs = asyncio.run(score_all())
    finally:
        pool.close()
    assert [(o.reward, o.success) for o in outs] == [(1.0, True), (pytest.approx(0.4), False)]


def test_the_api_module_exports_its_surface_and_imports_nothing_heavy():
    code = (
        "import sys, rollart_hpc.api as api\n"
        "assert all(hasattr(api, name) for name in api.__all__)\n"
        "print(sorted(m for m in ('torch', 'gymnasium', 'transformers', 'mpi4py') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
