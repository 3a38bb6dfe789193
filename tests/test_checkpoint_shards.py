"""Per-shard checkpoint reading: each trainer rank reads only its pipeline stage and tensor-parallel slice.

`convert.read_stage` through a `CheckpointReader` must give exactly the state dict of the whole-model
path (`load_weights` -> `hf_to_megatron` -> `to_stage`) for every (TP rank, PP stage), from a single
`model.safetensors` and from a sharded checkpoint (`model.safetensors.index.json`), and must read nothing
of another stage and only ~1/TP of every split tensor.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rollart_hpc.models.checkpoint import CheckpointReader, ShardWriter, expected_shapes, load_weights
from rollart_hpc.models.config import ModelConfig, config_from_dict
from rollart_hpc.train.convert import read_stage, stage_layers
from rollart_hpc.train.model import Layout, shard_weights


def _raw(model_type: str, tied: bool) -> dict[str, object]:
    return {
        "model_type": model_type,
        "vocab_size": 96,  # padded to 128: at TP 2 the second rank's rows are half padding
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": tied,
    }


def _write(folder: Path, raw: dict[str, object], files: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A random checkpoint in `files` safetensors files (1: a single `model.safetensors`, else an index)."""
    cfg = config_from_dict(raw)
    gen = torch.Generator().manual_seed(0)
    hf = {k: torch.randn(shape, generator=gen) for k, shape in sorted(expected_shapes(cfg).items())}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(raw))
    if files == 1:
        save_file(hf, str(folder / "model.safetensors"))
        return cfg, hf
    names, weight_map = list(hf), {}
    for i in range(files):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = names[i::files]
        save_file({n: hf[n] for n in part}, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return cfg, hf


def _layouts(tp: int, pp: int) -> Iterator[Layout]:
    for p in range(pp):
        for r in range(tp):
            yield Layout(tp, r, pp, p, 1, 0)


@pytest.mark.parametrize(
    "family,tied", [("llama", False), ("qwen2", True), ("qwen3", False), ("qwen3", True)]
)
@pytest.mark.parametrize("files", [1, 3])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
def test_read_stage_equals_the_whole_model_path(
    family: str, tied: bool, files: int, tp: int, pp: int, tmp_path: Path
) -> None:
    """TP 4 > 2 key/value groups: a rank's fused qkv rows are part of one group (read whole, then sliced)."""
    cfg, _ = _write(tmp_path / "m", _raw(family, tied), files)
    whole = load_weights(tmp_path / "m", cfg)
    for lay in _layouts(tp, pp):
        expected = shard_weights(whole, cfg, lay)
        with CheckpointReader(tmp_path / "m", cfg) as reader:
            got = read_stage(reader, cfg, lay.tp_rank, lay.tp_size, lay.pp_rank, lay.pp_size)
        assert set(got) == set(expected), lay
        for key, value in expected.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), (lay, key)
            assert got[key].is_contiguous()


def _stage_names(cfg: ModelConfig, pp_rank: int, pp_size: int) -> set[str]:
    layers = stage_layers(cfg.num_layers, pp_rank, pp_size)
    names = {
        n for n in expected_shapes(cfg) if n.startswith("model.layers.") and int(n.split(".")[2]) in layers
    }
    if pp_rank == 0:
        names.add("model.embed_tokens.weight")
    if pp_rank == pp_size - 1:
        names |= {"model.norm.weight"} | ({"model.embed_tokens.weight"} if cfg.tie_word_embeddings else set())
        names |= set() if cfg.tie_word_embeddings else {"lm_head.weight"}
    return names


@pytest.mark.parametrize("tied", [False, True])
def test_a_pipeline_stage_reads_only_its_tensors_and_files(tied: bool, tmp_path: Path) -> None:
    """One file per tensor: the files a stage opens are exactly those of its tensors."""
    cfg, hf = _write(tmp_path / "m", _raw("qwen2", tied), files=len(expected_shapes(_cfg("qwen2", tied))))
    weight_map = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())["weight_map"]
    for stage in range(2):
        with CheckpointReader(tmp_path / "m", cfg) as reader:
            read_stage(reader, cfg, 0, 1, stage, 2)
        mine = _stage_names(cfg, stage, 2)
        assert set(reader.read_bytes) == mine
        assert sorted(reader.opened) == sorted({weight_map[n] for n in mine})
        assert all(reader.read_bytes[n] == hf[n].numel() * 4 for n in mine)  # TP 1: whole tensors
        others = {n for n in hf if n.startswith("model.layers.")} - mine
        assert others and not others & set(reader.read_bytes)


def _cfg(family: str, tied: bool) -> ModelConfig:
    return config_from_dict(_raw(family, tied))


def test_a_tensor_parallel_rank_reads_its_slice_of_the_split_tensors(tmp_path: Path) -> None:
    cfg, hf = _write(tmp_path / "m", _raw("qwen2", False), files=3)
    replicated = {n for n in hf if n.endswith("norm.weight")}
    split = set(hf) - replicated
    vocab = {"model.embed_tokens.weight", "lm_head.weight"}
    tp = 2
    per_rank = []
    for rank in range(tp):
        with CheckpointReader(tmp_path / "m", cfg) as reader:
            read_stage(reader, cfg, rank, tp, 0, 1)
        assert set(reader.read_bytes) == set(hf)
        for name in replicated:
            assert reader.read_bytes[name] == hf[name].numel() * 4
        for name in split:  # vocabulary: 1/TP of the padded rows, whose padding is not read
            rows = 128 // tp if name in vocab else hf[name].shape[0] / tp
            assert reader.read_bytes[name] <= rows * hf[name][0].numel() * 4, name
        per_rank.append(reader.read_bytes)
    for name in split:  # together the ranks read each split tensor exactly once
        assert sum(r[name] for r in per_rank) == hf[name].numel() * 4, name
    total = sum(hf[n].numel() * 4 for n in hf)
    assert max(sum(r.values()) for r in per_rank) < 0.55 * total


def test_reader_refuses_a_bad_index(tmp_path: Path) -> None:
    cfg, _ = _write(tmp_path / "m", _raw("llama", False), files=2)
    index = tmp_path / "m" / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    weight_map.pop("model.norm.weight")
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"missing weights: \['model.norm.weight'\]"):
        CheckpointReader(tmp_path / "m", cfg)
    weight_map["model.norm.weight"] = "model-00009-of-00009.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with CheckpointReader(tmp_path / "m", cfg) as reader, pytest.raises(FileNotFoundError, match="absent"):
        reader.read("model.norm.weight")


def test_hf_save_pretrained_shards_load_like_a_single_file(tmp_path: Path) -> None:
    """A tiny model saved by transformers in several shards (`max_shard_size`) gives the same stage
    weights as the same model in one file, at TP 2 x PP 2."""
    from transformers import AutoModelForCausalLM

    from rollart_hpc.models.config import load_config
    from rollart_hpc.models.tiny import make_tiny_model

    single = make_tiny_model(
        tmp_path / "single", family="qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=64, vocab_size=300, tie_word_embeddings=True,
    )  # fmt: skip
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32).save_pretrained(
        sharded, max_shard_size="200KB"
    )
    assert (sharded / "model.safetensors.index.json").is_file() and len(
        list(sharded.glob("*.safetensors"))
    ) > 2
    cfg = load_config(single)
    for lay in _layouts(2, 2):
        with CheckpointReader(single, cfg) as a, CheckpointReader(sharded, cfg) as b:
            x = read_stage(a, cfg, lay.tp_rank, 2, lay.pp_rank, 2)
            y = read_stage(b, cfg, lay.tp_rank, 2, lay.pp_rank, 2)
        assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)
        assert len(b.opened) < len(list(sharded.glob("*.safetensors"))) or lay.pp_size == 1


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_gpt_from_a_sharded_checkpoint_equals_the_whole_model_path(
    tmp_path: Path, one_rank_group: None
) -> None:
    from rollart_hpc.train.model import ensure_model_parallel, gpt_from_hf

    cfg, hf = _write(tmp_path / "m", _raw("qwen3", False), files=4)
    ensure_model_parallel(0)
    model, _ = gpt_from_hf(tmp_path / "m", torch.device("cpu"))
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    expected = shard_weights(hf, cfg, Layout(1, 0, 1, 0, 1, 0))
    assert set(state) == set(expected) and all(torch.equal(state[k], expected[k]) for k in expected)


def test_shard_writer_holds_one_file_and_gives_a_large_tensor_a_file_alone(tmp_path: Path) -> None:
    tensors = {f"t{i}": torch.full((250,), float(i)) for i in range(10)}  # 1000 bytes each
    tensors["big"] = torch.arange(1000.0)  # 4000 bytes: more than a file
    writer = ShardWriter(tmp_path, 2500)
    for name, tensor in tensors.items():
        writer.add({name: tensor})
    files = writer.close()
    assert [len(names) for names in writer.files] == [2, 2, 2, 2, 2, 1]
    assert writer.peak_bytes == 4000 and writer.total_bytes == 14000
    assert [f.name for f in files][-1] == "model-00006-of-00006.safetensors"
    assert not list(tmp_path.glob(".part-*"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["big"] == files[-1].name and index["metadata"]["total_size"] == 14000
    from safetensors.torch import load_file

    back = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    single = ShardWriter(tmp_path / "one", 1 << 20)
    (tmp_path / "one").mkdir()
    single.add(tensors)
    assert [f.name for f in single.close()] == ["model.safetensors"]
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()
