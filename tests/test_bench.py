"""`arena-bench`: every subcommand in-process on tiny settings; the JSON's figures must be consistent.

No assertion is made on timings. The settings are shared between tests so that the jitted
simulation and model steps compile once per session.
"""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from arena_jax import models
from arena_jax.benchmarks import cli
from arena_jax.benchmarks.allocators import FirstFit
from arena_jax.benchmarks.capacity import CapacitySettings, run_capacity
from arena_jax.benchmarks.workload import WorkloadError, load_lengths, synthetic
from hf_reference import hf_reference  # noqa: F401  (a fixture: skips / fails as the CI line says where torch is absent)

# 128 MiB of Mistral-7B KV = 1,024 tokens = 64 pages; 256-token slabs: 4 max-length sequences.
CAPACITY = ["--budget-gib", "0.125", "--max-seq-len", "256", "--max-seqs", "32", "--requests", "40"]
DECODE = ["--batch", "2", "--prompt-len", "8", "--new-tokens", "5", "--repeats", "2", "--num-layers", "1", "--hf", "off"]
# test_models.py's shapes (tiny model, std 0.2, 4 rows, 6 pages of 16, 64 tokens, chunks of 8): compiled once per session.
PREFIX = ["--conversations", "5", "--turns", "2", "--system-prompts", "2", "--system-len", "24", "--user-len", "8",
          "--new-tokens", "6", "--num-pages", "6", "--chunk-size", "8"]  # fmt: skip


@pytest.fixture(autouse=True)
def _no_persistent_cache(monkeypatch):
    monkeypatch.setenv(cli.CACHE_ENV, "")


def _run(args, tmp_path, name="out.json"):
    path = tmp_path / name
    assert cli.main([*args, "--no-progress", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    for key in ("device", "jax_version", "date", "arguments", "results"):
        assert key in data, key
    return data


def _check_capacity(res, requests):
    allocs = res["allocators"]
    assert set(allocs) == {"arena", "contiguous_max", "contiguous_growth"}
    for a in allocs.values():
        assert 0 < a["utilization_mean"] <= 1 and 0 < a["utilization_p5"] <= a["utilization_mean"] + 1e-9
        assert 0 <= a["requests_waited"] <= requests
        assert a["mean_wait_steps"] >= 0 and a["preemptions"] >= 0
        assert 1 <= a["peak_concurrent"] <= res["settings"]["max_seqs"]
        assert a["mean_concurrent"] <= a["peak_concurrent"]
        assert a["total_steps"] >= a["busy_steps"] > 0
        assert a["waste_tokens_per_seq"] >= 0
    arena, cmax, grow = allocs["arena"], allocs["contiguous_max"], allocs["contiguous_growth"]
    assert arena["peak_concurrent"] >= cmax["peak_concurrent"]
    assert arena["utilization_mean"] >= cmax["utilization_mean"]
    # Page-granular waste is under one page per sequence; a max-length slab wastes far more.
    assert arena["waste_tokens_per_seq"] < res["settings"]["page_size"] < cmax["waste_tokens_per_seq"]
    assert cmax["preemptions"] == 0 and cmax["peak_concurrent"] <= res["settings"]["budget_tokens"] // res["settings"]["max_seq_len"]
    # Everything given back at the end; every page allocated was recycled.
    assert arena["leaked_pages_after_drain"] == 0 and arena["pages_allocated"] == arena["pages_recycled"] > 0
    assert cmax["leaked_tokens_after_drain"] == 0 and grow["leaked_tokens_after_drain"] == 0
    assert arena["cow_copies"] == 0
    g = res["goals"]
    assert g["arena_utilization"] == arena["utilization_mean"]
    assert g["arena_utilization_met"] == (g["arena_utilization"] >= g["arena_utilization_goal"])
    assert g["capacity_ratio_met"] == (g["capacity_ratio_peak"] >= g["capacity_ratio_goal"])
    assert res["health_checks"] >= 1


def test_capacity(tmp_path, capsys):
    data = _run(["capacity", *CAPACITY, "--plot", str(tmp_path / "cap.png")], tmp_path)
    res = data["results"]
    assert data["command"] == "capacity" and data["arguments"]["requests"] == 40
    assert res["workload"]["requests"] == 40
    _check_capacity(res, 40)
    assert (tmp_path / "cap.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "arena (arena_jax)" in out and "contiguous max-length" in out and "goal:" in out


def test_arena_device_scheduler_matches_host_scheduler():
    """The device-side loop (default) and the host-driven per-step calls give identical figures."""
    s = CapacitySettings(model="mistral-7b", bytes_per_token=131072, budget_bytes=2**27, max_seq_len=256, max_seqs=32)
    wl = synthetic(40, seed=3, rate=0.3, max_seq_len=256)
    device = run_capacity(wl, s)["allocators"]["arena"]
    host = run_capacity(wl, s, host_scheduler=True)["allocators"]["arena"]
    for key in device:
        if key not in ("wall_s", "steps_per_s"):
            assert device[key] == host[key], key


def test_capacity_replays_lengths_file(tmp_path):
    f = tmp_path / "lengths.csv"
    rows = [(30, 40), (100, 120), (5, 200), (250, 50), (60, 60)] * 6
    f.write_text("prompt_len,output_len\n" + "\n".join(f"{p},{o}" for p, o in rows) + "\n")
    res = _run(["capacity", *CAPACITY, "--lengths", str(f)], tmp_path)["results"]
    w = res["workload"]
    assert w["source"] == str(f) and w["requests"] == len(rows)
    assert w["clipped_to_max_seq_len"] == 6  # 250 + 50 > 256, six times
    _check_capacity(res, len(rows))


def test_decode(tmp_path, capsys):
    res = _run(["decode", *DECODE, "--plot", str(tmp_path / "dec.png")], tmp_path)["results"]
    assert res["same_tokens"] is True and res["first_mismatch"] is None
    assert res["transformers"] is None  # --hf off
    assert res["arena_deterministic_across_repeats"] is True
    for side in ("arena", "dense"):
        r = res[side]
        assert r["tokens_per_s"] > 0 and r["step_ms_p99"] >= r["step_ms_p50"] > 0
        assert len(r["tokens_per_s_repeats"]) == 2 and len(r["step_ms"]) == 2 * 4
        assert r["compile_prefill_s"] >= 0 and r["compile_decode_s"] >= 0
        assert r["compile_s"] == r["compile_prefill_s"] + r["compile_decode_s"]
        assert r["warm_step_ms_p50"] is None and r["cold_steps"] == 4  # 4 steps a run: none settled
    assert res["arena"]["kv_bytes_per_token"] == res["dense"]["kv_bytes_per_token"] > 0
    assert res["speedup_tokens_per_s"] == pytest.approx(res["arena"]["tokens_per_s"] / res["dense"]["tokens_per_s"])
    out = capsys.readouterr().out
    assert "greedy tokens: match" in out and "of which the decode step" in out


def test_decode_builds_the_layers_as_load_pretrained_does(monkeypatch):
    """`arena-bench decode` runs random weights as `load_pretrained` would build the model on this
    platform (`models.default_scan_layers`: a list on a CPU for layers of 1 MiB or more, whose
    matmuls read them in place; stacked otherwise); --scan-layers / --no-scan-layers choose, not both."""
    from arena_jax.benchmarks import decode

    parse = lambda *flags: cli._decode_settings(cli.build_parser().parse_args(["decode", *flags]))  # noqa: E731
    assert (parse().scan_layers, parse("--scan-layers").scan_layers, parse("--no-scan-layers").scan_layers) == (None, True, False)
    with pytest.raises(SystemExit):
        parse("--scan-layers", "--no-scan-layers")
    asked = []
    for default in (True, False):
        monkeypatch.setattr(models, "default_scan_layers", lambda cfg, dtype, d=default: asked.append(cfg.num_layers) or d)
        model, text = decode.build_model(parse())
        assert model.scan_layers is default and text.endswith("(models.default_scan_layers)")
        assert ("layers in a scan" if default else "a list of layers") in text
    assert asked == [models.LlamaConfig.tiny().num_layers] * 2
    model, text = decode.build_model(parse("--no-scan-layers"))
    assert model.scan_layers is False and text.endswith("a list of layers")
    monkeypatch.undo()
    assert models.default_scan_layers(models.LlamaConfig.tiny(), np.float32, "cpu")  # the tiny preset: stacked on a CPU


def test_decode_another_family(tmp_path):
    """A Gemma 3 preset (5 local : 1 global layers, windows of 8 shorter than the 12-token prompts,
    two RoPE bases): arena and dense baseline give the same greedy tokens."""
    args = ["decode", "--model", "tiny-gemma3", "--batch", "2", "--prompt-len", "12", "--new-tokens", "5", "--repeats", "1"]
    res = _run(args, tmp_path)["results"]
    assert res["same_tokens"] is True and res["first_mismatch"] is None


def test_decode_mid_preset_is_the_studies_mid_model(tmp_path):
    """`--model mid`: the mid model of RESULTS.md's figures (the studies' `context_cost` geometry),
    in float32 by default as the tiny presets; one of its layers runs, arena and dense agree."""
    from arena_jax.benchmarks.presets import CPU_PRESETS, default_dtype, preset
    from arena_jax.benchmarks.studies.context_cost import Settings

    shape = lambda cfg: {k: v for k, v in vars(cfg).items() if k != "max_position_embeddings"}  # noqa: E731
    assert shape(preset("mid")) == shape(Settings().config())
    assert "mid" in CPU_PRESETS and default_dtype("mid") == default_dtype("tiny-qwen3") == "float32"
    assert default_dtype("llama3-8b") == "bfloat16"
    with pytest.raises(SystemExit):  # capacity sizes by the real models' KV only
        cli.build_parser().parse_args(["capacity", "--model", "mid"])
    res = _run(["decode", "--model", "mid", "--num-layers", "1", "--batch", "1", "--prompt-len", "4", "--new-tokens", "2",
                "--repeats", "1", "--hf", "off"], tmp_path)["results"]  # fmt: skip
    assert res["settings"]["dtype"] == "float32" and res["settings"]["config"]["hidden_size"] == 512
    assert res["arena"]["kv_bytes_per_token"] == 1 * 2 * 2 * 64 * 4  # 1 layer, K and V, 2 KV heads, head_dim 64, f32
    assert res["same_tokens"] is True and res["first_mismatch"] is None


@pytest.mark.usefixtures("hf_reference")
def test_decode_against_transformers(tmp_path, capsys):
    """The second peer: transformers' own Gemma 2 model (soft-caps, a window of 8 on every other
    layer, shorter than the 12-token prompts) on the same weights gives the arena's greedy tokens."""
    args = ["decode", "--model", "tiny-gemma2", "--batch", "2", "--prompt-len", "12", "--new-tokens", "5", "--repeats", "1",
            "--hf", "on"]  # fmt: skip
    res = _run(args, tmp_path)["results"]
    peer = res["transformers"]
    assert peer["model_class"] == "Gemma2ForCausalLM" and peer["torch_threads"] == 1
    assert peer["same_tokens"] is True and peer["token_agreement"] == 1.0 and res["same_tokens"] is True
    assert peer["tokens_per_s"] > 0 and len(peer["step_ms"]) == 4
    assert "greedy tokens vs the arena's: match" in capsys.readouterr().out


def test_prefix(tmp_path, capsys):
    res = _run(["prefix", *PREFIX, "--plot", str(tmp_path / "prefix.png")], tmp_path)["results"]
    assert res["settings"]["layout"]["max_seq_len"] == 64 and res["same_tokens"] is True
    none, pre = res["none"], res["prefix"]
    assert none["hit_tokens"] == 0 and none["prefill_tokens"] == none["prompt_tokens"]
    assert pre["hit_tokens"] > 0 and pre["prefill_tokens"] == pre["prompt_tokens"] - pre["hit_tokens"] < none["prefill_tokens"]
    assert pre["hit_rate"] == pytest.approx(pre["hit_tokens"] / pre["prompt_tokens"])
    assert pre["evictions"] > 0 and pre["cached_pages_end"] > 0 and none["cached_pages_end"] == 0  # 6 pages: under pressure
    for side in (none, pre):
        assert side["ttft_ms_p99"] >= side["ttft_ms_p50"] > 0 and side["tokens_per_s"] > 0 and side["rejected_rows"] == 0
        assert side["generated"] == 5 * 2 * 6 and len(side["ttft_ms"]) == 5 * 2
        assert [t["turn"] for t in side["per_turn"]] == [1, 2]
    assert res["prefill_ratio"] == pytest.approx(pre["prefill_tokens"] / none["prefill_tokens"])
    assert (tmp_path / "prefix.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "prefill tokens computed" in out and "greedy tokens: match" in out


def test_layout(tmp_path, capsys):
    res = _run(["layout"], tmp_path)["results"]
    by = {r["model"]: r for r in res["models"]}
    assert by["mistral-7b"]["bytes_per_token"] == 131_072
    assert by["llama3-8b"]["bytes_per_token"] == 131_072
    assert by["llama3-70b"]["bytes_per_token"] == 327_680
    assert by["mistral-7b"]["num_pages"] == 40 * 2**30 // (131_072 * 16)
    assert "131,072" in capsys.readouterr().out


def test_kernels(tmp_path):
    res = _run(["kernels", "--batches", "1", "--contexts", "64", "--repeats", "1"], tmp_path)["results"]
    assert res["rows"] and all(r["batch"] == 1 and r["context"] == 64 for r in res["rows"])
    if res["metadata"]["backend"] != "gpu":
        assert "need a GPU" in res["metadata"]["note"]
    # An 8-bit arena: the KV bytes read count a float32 scale per token row (8 KV heads x d128).
    res = _run(["kernels", "--batches", "1", "--contexts", "64", "--repeats", "1", "--dtype", "int8"], tmp_path)["results"]
    assert res["metadata"]["dtype"] == "int8"
    assert all(r["kv_bytes"] == 2 * 64 * 8 * (128 + 4) for r in res["rows"])


def test_layout_and_capacity_count_8bit_scales(tmp_path, capsys):
    res = _run(["layout", "--kv-dtype", "int8"], tmp_path)["results"]
    by = {r["model"]: r for r in res["models"]}
    assert by["mistral-7b"]["bytes_per_token"] == 2 * 32 * 8 * (128 + 4) == 67_584
    assert by["mistral-7b"]["scale_bytes_per_token"] == 2 * 32 * 8 * 4
    assert by["mistral-7b"]["num_pages"] == 40 * 2**30 // (67_584 * 16)
    assert "int8 + f32 scales" in capsys.readouterr().out
    import argparse

    args = cli.build_parser().parse_args(["capacity", "--kv-dtype", "float8_e5m2"])
    settings, bf16 = cli._capacity_settings(args), cli._capacity_settings(argparse.Namespace(**{**vars(args), "kv_dtype": "bfloat16"}))
    assert settings.bytes_per_token == 67_584 and bf16.bytes_per_token == 131_072
    assert settings.budget_tokens == 2**30 // 67_584 == 15_887 and bf16.budget_tokens == 8_192  # 1.94x
    assert cli._decode_settings(cli.build_parser().parse_args(["decode", "--kv-dtype", "int8"])).kv_dtype == "int8"


def test_layout_and_capacity_count_int4_group_scales(tmp_path, capsys):
    """int4: head_dim / 2 bytes + a bf16 scale per 32 lanes, for K and V: 3.56x bf16's tokens per budget."""
    res = _run(["layout", "--kv-dtype", "int4"], tmp_path)["results"]
    by = {r["model"]: r for r in res["models"]}
    assert by["mistral-7b"]["bytes_per_token"] == 2 * 32 * 8 * (128 // 2 + (128 // 32) * 2) == 36_864
    assert by["mistral-7b"]["scale_bytes_per_token"] == 2 * 32 * 8 * 4 * 2
    assert "int4 + bf16 scales per 32 lanes" in capsys.readouterr().out
    import argparse

    args = cli.build_parser().parse_args(["capacity", "--kv-dtype", "int4"])
    settings, bf16 = cli._capacity_settings(args), cli._capacity_settings(argparse.Namespace(**{**vars(args), "kv_dtype": "bfloat16"}))
    assert settings.budget_tokens == 2**30 // 36_864 == 29_127 and settings.budget_tokens >= 3.5 * bf16.budget_tokens


def test_accuracy_attention_measurement():
    """`arena-bench accuracy`'s attention measurement on tiny settings (int4 with rotated keys,
    smoothed or not, and tiny heads, to keep compiles few): bf16 errs against float64 by bf16's
    rounding and is its own reference; int4 errs more; smoothing lowers the error of outlier
    keys; the Pallas kernels (interpret mode) agree with the reference; the table prints every
    row. (Rotation vs none: test_quantized4.py.)"""
    from arena_jax.benchmarks.accuracy import AccuracySettings, attention_accuracy, format_attention_table, split_format

    settings = AccuracySettings(context=16, batch=1, outliers=1, q_heads=4, kv_heads=2, head_dim=64,
                                outlier_scales=(1.0, 50.0), formats=("int4",), key_options=("+rot", "+smooth+rot"))
    rows = attention_accuracy(settings)
    by = {(r["outlier_scale"], r["format"]): r for r in rows}
    err = lambda scale, fmt: by[(scale, fmt)]["rel_err_vs_f64"]["reference"]  # noqa: E731
    assert by[(1.0, "bfloat16")]["rel_err_vs_bf16"] == 0 and 0 < err(1.0, "bfloat16") < 1e-2
    assert err(1.0, "bfloat16") < err(1.0, "int4+rot") < 0.3 and err(50.0, "bfloat16") < err(50.0, "int4+rot") < 0.5
    assert err(50.0, "int4+smooth+rot") < 0.75 * err(50.0, "int4+rot")
    for r in rows:
        assert r["backend_max_diff"] < 1e-4, r
        assert abs(r["rel_err_vs_f64"]["pallas"] - r["rel_err_vs_f64"]["reference"]) < 1e-4, r
    assert len(format_attention_table(rows).splitlines()) == 2 + 2 * 3
    assert split_format("int8+rot+smooth") == ("int8", True, True) and split_format("bfloat16") == ("bfloat16", None, None)
    with pytest.raises(ValueError, match="int8\\+rotate"):
        split_format("int8+rotate")


def test_key_outliers_leave_the_model_function_unchanged():
    """`with_key_outliers` (arena-bench accuracy --model-key-outliers): one RoPE channel pair per
    layer and KV head of the key projection x20, the same channels of its query heads / 20: the
    logits on a float32 arena stay those of the model as drawn, while the key projection's
    columns now hold the outliers."""
    from arena_jax.benchmarks.accuracy import PARITY_CONFIGS, _teacher_forced, with_key_outliers

    model = models.init_random(PARITY_CONFIGS["llama_gqa_rope3_tied"](), seed=3, std=0.2)
    rng = np.random.default_rng(3)
    sequences = [rng.integers(0, 128, n).tolist() for n in (9, 14)]
    before = _teacher_forced(model, "float32", sequences, [0, 0], chunk=8)
    k_before = np.array(model.layers.attn.k[...])
    with_key_outliers(model, 20.0, seed=3)
    after = _teacher_forced(model, "float32", sequences, [0, 0], chunk=8)
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4 * np.abs(before).max())
    ratio = np.linalg.norm(np.array(model.layers.attn.k[...]), axis=1) / np.linalg.norm(k_before, axis=1)  # [L, Hkv, D]
    half = ratio.shape[-1] // 2
    np.testing.assert_allclose(np.sort(ratio, axis=-1)[..., -2:], 20.0, rtol=1e-6)  # one pair per head ...
    np.testing.assert_allclose(np.sort(ratio, axis=-1)[..., :-2], 1.0)  # ... and nothing else
    np.testing.assert_array_equal(ratio[..., :half] > 1, ratio[..., half:] > 1)  # the pair is (c, c + D / 2)
    with pytest.raises(ValueError, match="scale"):
        with_key_outliers(model, 0.0)
    q_before = np.array(model.layers.attn.q[...])
    with_key_outliers(model, 20.0, seed=4, queries="loud")  # keys scaled again, queries left as they were
    np.testing.assert_array_equal(np.array(model.layers.attn.q[...]), q_before)
    assert np.sort(np.linalg.norm(np.array(model.layers.attn.k[...]), axis=1) / np.linalg.norm(k_before, axis=1)).max() >= 20


def test_kernels_compile_report(tmp_path, capsys):
    """With the CUDA compile tooling: the table of one variant, no spills. Without it: a clear
    error (exit status 2) naming what is missing."""
    from pallas_kernels.offline import sm90

    problem = sm90.tooling_problem()
    argv = ["kernels", "--compile-report", "--only", "append-decode bf16"]
    if problem:
        with pytest.raises(SystemExit) as exc:
            cli.main(argv + ["--no-progress"])
        assert exc.value.code == 2 and "cannot compile for sm_90a here" in capsys.readouterr().err
        return
    res = _run(argv, tmp_path)["results"]
    (row,) = res["rows"]
    assert row["variant"] == "append-decode bf16 d256 p16" and row["kernel"].startswith("paged_append")
    assert row["spill_stores"] == row["spill_loads"] == 0 and row["regs"] > 0
    out = capsys.readouterr().out
    assert "regs/thr" in out and "spills: none" in out


def test_tour(tmp_path, monkeypatch, capsys):
    # The tour on the settings above (same shapes: nothing new to compile).
    import warnings

    from arena_jax import arena_ops, state

    monkeypatch.setattr(cli, "TOUR_CAPACITY", {"budget_gib": 0.125, "requests": 40, "max_seq_len": 256, "max_seqs": 32})
    monkeypatch.setattr(cli, "TOUR_DECODE", {"batch": 2, "prompt_len": 8, "new_tokens": 5, "repeats": 2, "num_layers": 1})
    for module in (state, arena_ops):  # every warning not given yet in this process may be given again
        monkeypatch.setattr(module, "_WRITE_COPY_WARNED", set(), raising=False)
    monkeypatch.setenv("COLUMNS", "80")  # a newcomer's terminal (capsys is none: the console reads $COLUMNS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = _run(["tour"], tmp_path)["results"]
    # Issue 40, item 6: its bf16 arenas are only sized (layout, memory checks) and reserved / released
    # (capacity), never appended to: no "each append copies the arena" (jax 0.10's CPU said so).
    copies = [str(w.message) for w in caught if "copies the arena" in str(w.message)]
    assert not copies, copies
    assert set(res) == {"layout", "capacity", "decode"}
    _check_capacity(res["capacity"], 40)
    assert res["decode"]["same_tokens"] is True
    out = capsys.readouterr().out
    assert "summary" in out and "131,072" in out and "327,680" in out
    # Issue 40, item 6: its tables were cut at 80 columns ("…" in cells). Every line fits, no cell is cut.
    long = [line for line in out.splitlines() if len(line) > 80]
    assert not long and "…" not in out, "\n".join(long) or out
    assert "2,621,440" in out and "llama3-70b" in out and "contiguous" in out and "+25% growth" in out
    # Issue 40, item 6: the decode ratio came with no word of what it means. Now the run's own step
    # times say it, and where the figures at a real model's size are.
    text, d = " ".join(out.split()), res["decode"]
    said = (f"What {d['speedup_tokens_per_s']:.2f}x means: a decode step took {d['arena']['step_ms_mean']:.3f} ms on "
            f"the arena and {d['dense']['step_ms_mean']:.3f} ms on the dense cache (mean)")
    ratio, arena, dense = d["speedup_tokens_per_s"], d["arena"]["step_ms_mean"], d["dense"]["step_ms_mean"]
    # The step times it quotes are the ratio's own (batch / tokens/s): they say what it says.
    assert ratio == pytest.approx(dense / arena, rel=1e-9)
    if ratio < 1:  # slower: the report says why
        assert said in text and "does not amortize" in text and "benchmarks/RESULTS.md, 'Layer weights read in place: the step time on an H200'" in text, text
    else:
        assert f"What {ratio:.2f}x means: the arena decoded" in text and "does not amortize" not in text, text
    results_md = os.path.join(os.path.dirname(cli.__file__), "RESULTS.md")  # the section it points at is there
    assert "\n### Layer weights read in place: the step time on an H200 (issue 39, item 1)\n" in open(results_md, encoding="utf-8").read()


def test_warm_steps_are_each_runs_steps_past_its_cold_ones():
    from arena_jax.benchmarks import decode

    runs = [[0.9, 0.5, 0.4, 0.3, 0.1, 0.2], [0.8, 0.6, 0.5, 0.4, 0.3]]  # seconds; each run's first steps cold
    s = decode._summary([0.01, 0.01], runs, batch=2, first_prefill=1.0, first_steps=[1.0])
    assert decode.COLD_STEPS == s["cold_steps"] == 4
    assert s["warm_step_ms_p50"] == pytest.approx(200.0)  # the median of 100, 200 and 300 ms


@pytest.mark.parametrize("arena, dense", [(0.5, 0.4), (0.33, 0.33), (0.3, 0.36)])
def test_decode_ratio_lines_follow_the_step_times(arena, dense):
    """The tour's word on its ratio quotes the ratio's own step times (the runs' mean steps, batch
    / tokens/s): "does not amortize" exactly when the arena is slower. (It quoted p50 steps, which
    can disagree with a tokens/s ratio: a 0.90x explained by 0.004 ms.)"""
    from arena_jax.benchmarks import report

    ratio = dense / arena
    result = {"speedup_tokens_per_s": ratio, "settings": {"prompt_len": 8, "new_tokens": 5}, "device": "cpu",
              "arena": {"step_ms_mean": arena}, "dense": {"step_ms_mean": dense}}  # fmt: skip
    text = " ".join(report.decode_ratio_lines(result))
    assert text.startswith(f"What {ratio:.2f}x means:")
    assert f"{arena:.3f} ms" in text and f"{dense:.3f} ms" in text
    assert ("does not amortize" in text) == (ratio < 1) == ("benchmarks/RESULTS.md" in text)
    if ratio < 1:
        assert f"The {arena - dense:.3f} ms more" in text
        assert "Past each run's first" not in text  # no warm steps measured: no word on them
        result["arena"].update(warm_step_ms_p50=0.8 * arena, cold_steps=4)
        result["dense"].update(warm_step_ms_p50=0.9 * dense, cold_steps=4)
        text = " ".join(report.decode_ratio_lines(result))
        assert (f"Past each run's first 4 decode steps, which start cold after its prefill and cost the longer step "
                f"more, the median steps are {0.8 * arena:.3f} and {0.9 * dense:.3f} ms "
                f"({0.9 * dense / (0.8 * arena):.2f}x).") in text


@pytest.mark.parametrize("arena, dense", [(2.94, 0.98), (0.9, 1.1)])
def test_compile_ratio_line_quotes_the_runs_first_calls(arena, dense):
    """The tour's compile row (issue 39, item 4: 2-3x on the tiny model) gets a line: this run's
    seconds, the difference and what it is made of where the arena took longer, the RESULTS
    section it points at (which exists), and the tools' persistent compilation cache."""
    from arena_jax.benchmarks import report

    text = report.compile_ratio_line({"arena": {"compile_s": arena}, "dense": {"compile_s": dense}})
    assert f"took {arena:.2f} s on the arena and {dense:.2f} s on the dense cache" in text
    assert (f"The {arena - dense:.2f} s more" in text) == (arena > dense) == ("persistent compilation cache" in text)
    results_md = os.path.join(os.path.dirname(report.__file__), "RESULTS.md")
    assert f"\n### {report.COMPILE_SECTION}\n" in open(results_md, encoding="utf-8").read()


def test_help_says_what_each_subcommand_does(capsys):
    """Issue 40, item 6: `arena-bench --help` showed the internal docstring of the module that
    builds the parser. Now a paragraph for users naming the subcommands; each subcommand's --help
    opens with what it measures; every flag has a help text and no "(default: None)"."""
    import inspect

    from arena_jax.benchmarks import arguments
    from arena_jax.benchmarks.kernels import run_kernel_benchmark

    parser = cli.build_parser()
    for argv in ([], *([name] for name in parser.subcommands)):
        with pytest.raises(SystemExit) as exc:
            cli.main([*argv, "--help"])
        assert exc.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "build_parser" not in text and "argparse" not in text and "(default: None)" not in text, (argv, text)
        assert "(default: False)" not in text, (argv, text)
        if not argv:
            assert "Measure what arena_jax's paged KV cache buys" in text and "command line:" not in text, text
            assert all(f"{name} " in text for name in parser.subcommands)
            continue
        sub = parser.subcommands[argv[0]]
        assert sub.description and " ".join(sub.description.split()) in text, argv
        for action in sub._actions:
            if action.option_strings and action.help != "show this help message and exit":
                assert action.help, f"arena-bench {argv[0]} {max(action.option_strings, key=len)} has no help"
    defaults = {k: p.default for k, p in inspect.signature(run_kernel_benchmark).parameters.items()}
    assert {k: defaults[k] for k in arguments.KERNEL_DEFAULTS} == arguments.KERNEL_DEFAULTS  # what kernels --help names


@pytest.mark.parametrize(
    "argv",
    [
        ["capacity", "--budget-gib", "-1"],
        ["capacity", "--budget-gib", "lots"],
        ["capacity", "--requests", "0"],
        ["capacity", "--rate", "fast"],
        ["capacity", "--model", "gpt-5"],
        ["capacity", "--budget-gib", "0.01"],  # holds fewer tokens than one max-length sequence
        ["capacity", "--lengths", "/nonexistent/lengths.csv"],
        ["decode", "--batch", "0"],
        ["decode", "--model", "nope"],
        ["decode", "--new-tokens", "1"],
        ["decode", "--model-dir", "/nonexistent/checkpoint"],
        ["prefix", "--turns", "0"],
        ["prefix", "--num-pages", "4", "--budget-gib", "1"],
        ["prefix", "--system-len", "600"],  # past the tiny model's 512 positions
        ["prefix", "--num-pages", "2"],  # fewer pages than the longest request needs
        ["kernels", "--contexts", "1,x"],
        ["frobnicate"],
        ["accuracy", "--key-options", "rotate"],  # not plain / rot / smooth / smooth+rot
        ["accuracy", "--formats", "int9"],
        ["accuracy", "--model-formats", "bfloat16+rot"],  # key options on a float arena
        ["accuracy", "--model-key-outliers", "0"],
        ["accuracy", "--model-key-outliers", "nan"],
        ["capacity", "--no-such-flag"],
        ["layout", "--json", "/proc/no/such/place.json"],
        ["--bogus"],
    ],
)
def test_bad_flags_exit_cleanly(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def _is_usage_error(argv, message, capsys):
    """arena-bench ARGV exits 2 with a usage error matching `message`, no traceback."""
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"arena-bench {argv[0]}: error:" in err and "Traceback" not in err
    assert re.search(message, err), err


# Numbers that used to overflow (float -> int, int32 wraps) or allocate terabytes before failing
# with a traceback: each is a usage error naming the flag and the limit, before any run.
@pytest.mark.parametrize(
    "argv, message",
    [
        (["layout", "--budget-gib", "1e300"], r"--budget-gib: expected a finite number in \(0, 1,048,576\], got 1e300"),
        (["layout", "--budget-gib", "inf"], "--budget-gib: expected a finite number"),
        (["layout", "--budget-gib", "1000000", "--page-size", "1"],
         r"--budget-gib 1e\+06 is 8,192,000,000 pages of mistral-7b .* more than the 2,147,483,646 an int32 page table"),
        (["layout", "--page-size", "2000000000"], "holds no page of mistral-7b: one page of --page-size 2000000000"),
        (["layout", "--page-size", "3000000000"], r"--page-size: expected an integer in \[1, 2147483647\]"),
        (["capacity", "--budget-gib", "1e300"], "--budget-gib: expected a finite number"),
        (["capacity", "--max-seqs", "2000000000"], r"--max-seqs 2000000000.*needs .* bytes.*page table.*more than 90% of the"),
        (["capacity", "--requests", "2000000000"], r"needs .* bytes: 2,000,000,000 requests.* this host \(RAM\)"),
        (["capacity", "--headroom", "1e300"], r"--headroom: expected a finite number in \(0, 1,000,000\]"),
        (["capacity", "--seed", "-1"], r"--seed: expected an integer in \[0, 2147483647\]"),
        (["decode", "--batch", "100000000"],
         r"--batch 100000000, .*: tiny needs .* bytes: weights .* paged arena .* dense cache .*more than 90% of the .* bytes"),
        (["decode", "--num-layers", "2000000000"], r"--num-layers 2000000000: tiny needs .* bytes"),
        (["decode", "--seed", "99999999999"], r"--seed: expected an integer in \[0, 2147483647\], got 99999999999"),
        (["decode", "--batch", "3000000000"], r"--batch: expected an integer in \[1, 2147483647\]"),
        (["kernels", "--batches", "1,99999999999"], r"--batches: expected comma-separated integers in \[1, 2147483647\]"),
        (["kernels", "--num-kv-heads", "200000000", "--num-q-heads", "200000000"], r"needs .* bytes: arena .*more than 90%"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else "",
)  # fmt: skip
def test_absurd_numbers_are_usage_errors(argv, message, capsys):
    _is_usage_error(argv, message, capsys)


@pytest.mark.parametrize("path", ["/proc/version", "/proc/no/such/place.json", "/sys/kernel/arena.json", "."])
def test_unwritable_outputs_fail_before_the_run(path, capsys):
    """Really probed (as root, os.access says a read-only /proc file or folder is writable)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["capacity", *CAPACITY, "--no-progress", "--json", path])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert f"--json {path}: cannot write there" in captured.err and "capacity: serving" not in captured.out
    with pytest.raises(SystemExit):
        cli.main(["decode", *DECODE, "--no-progress", "--plot", path])
    assert f"--plot {path}: cannot write there" in capsys.readouterr().err


def test_write_probe_leaves_nothing_behind(tmp_path, capsys):
    target = tmp_path / "out.json"
    with pytest.raises(SystemExit):  # the output is writable; the budget is not
        cli.main(["layout", "--budget-gib", "0.0001", "--json", str(target)])
    assert "--budget-gib" in capsys.readouterr().err and not target.exists()
    existing = tmp_path / "keep.json"
    existing.write_text("{}")
    with pytest.raises(SystemExit):
        cli.main(["layout", "--budget-gib", "0.0001", "--json", str(existing)])
    assert existing.read_text() == "{}"  # probed without truncating


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_an_output_in_a_missing_folder_is_a_usage_error(flag, tmp_path, monkeypatch, capsys):
    """Issue 40, item 6: `--json some/missing/dir/out.json` created the folders without a word (a
    typo left a tree behind). Now a usage error naming the flag and the folder, before any work."""
    monkeypatch.chdir(tmp_path)
    path = os.path.join("some", "missing", "dir", "out.json")
    with pytest.raises(SystemExit) as exc:
        cli.main(["capacity", *CAPACITY, "--no-progress", flag, path])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert f"{flag} {path}: cannot write there (the folder {os.path.dirname(path)} does not exist" in captured.err
    assert "capacity: serving" not in captured.out and not os.path.exists("some")
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        cli.main(["layout", "--json", os.path.join("file", "out.json")])
    assert "--json file/out.json: cannot write there (the folder file is not a folder" in capsys.readouterr().err


def test_capacity_refuses_a_page_longer_than_the_sequence(capsys):
    """Issue 37: `--page-size 3000` (past --max-seq-len 2048) ran and reported a meaningless 13% utilization."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["capacity", "--page-size", "3000", "--no-progress"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert "arena-bench capacity: error: --page-size 3000 is longer than --max-seq-len 2048" in captured.err
    assert "capacity: serving" not in captured.out  # refused before any work


def test_capacity_refuses_lengths_longer_than_the_sequence(tmp_path, capsys):
    """Issue 37: a --lengths prompt of --max-seq-len tokens or more was cut to max_seq_len - 1 (another request);
    refused, naming the file, the flag and the first such request. Outputs past it are still cut, counted and
    reported (test_capacity_replays_lengths_file)."""
    f = tmp_path / "long.csv"
    f.write_text("prompt_len,output_len\n30,40\n256,10\n900,5\n")
    with pytest.raises(SystemExit) as exc:
        cli.main(["capacity", *CAPACITY, "--lengths", str(f), "--no-progress"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert (f"--lengths {f}: 2 of 3 requests have a prompt of --max-seq-len 256 tokens or more (request 2: 256 tokens)"
            in captured.err)  # fmt: skip
    assert "capacity: serving" not in captured.out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["capacity", "--rate", "inf"], r"--rate: expected 'auto' or a finite number of requests per step >= 0, got 'inf'"),
        (["capacity", "--rate", "1e-300"], r"--rate 1e-300: 100 requests arrive over ~9.9e\+301 steps, past the simulation's int32"),
        (["decode", "--new-tokens", "600", "--hf", "off"],
         "--prompt-len 32 \\+ --new-tokens 600 = 632 tokens exceed the model's max_position_embeddings 512"),
        (["decode", "--model-dir", "/nonexistent", "--num-layers", "2"], "--num-layers has no effect with --model-dir"),
        # was minutes building a layer pattern of 1e9 entries (tests/test_cli_fuzz.py's deadline caught it):
        (["prefix", "--model", "tiny-gemma3", "--num-layers", "1000000000"], r"--num-layers 1000000000: tiny-gemma3 needs"),
        (["decode", "--hf-threads", "100000"], r"--hf-threads: expected an integer in \[1, \d+\]"),
        (["prefix", "--page-size", "2147483647"], "--batch 4, --page-size 2147483647, .*: .*int32"),  # the layout's words
        (["swap", "--prompt-len", "600"], r"--prompt-len 600 \(\+ up to half of it\) \+ --new-tokens 64 = 964 tokens exceed"),
        (["kernels", "--target", "tpu-v5e"], "--target has no effect without --compile-report"),
        (["kernels", "--compile-report", "--batches", "8"], "--batches has no effect with --compile-report"),
        (["kernels", "--compile-report", "--steps"], "--steps compiles the TPU model steps: give it with --target"),
        (["kernels", "--num-q-heads", "6", "--num-kv-heads", "4"], "--num-q-heads 6 must be a multiple of --num-kv-heads 4"),
        (["accuracy", "--skip-models", "--skip-attention"], "--skip-models with --skip-attention measures nothing"),
        (["accuracy", "--skip-models", "--new-tokens", "8"], "--new-tokens has no effect with --skip-models"),
        (["accuracy", "--model-outlier-queries", "loud"], "--model-outlier-queries has no effect without --model-key-outliers"),
        (["accuracy", "--new-tokens", "300"], "--new-tokens 300: .* exceed its models' max_position_embeddings 256: at most 236"),
        (["accuracy", "--heads", "4,2,0", "--outliers", "0"], "head_dim a positive multiple of 32"),
        (["accuracy", "--heads", "4,2,32", "--outliers", "32"], "outliers x KV heads <= head_dim"),  # was numpy's error
        (["prefix", "--conversations", "1000000000"], r"--conversations 1000000000 x --turns 3 .*: needs .* this host"),
        (["swap", "--requests", "1000000000"], r"--requests 1000000000 of up to 352 tokens .*: needs .* this host"),
        (["capacity", "--watermark", "0.9", *CAPACITY], r"--watermark 0.9 keeps 57 of the budget's 64 pages free .* could "
                                                        "never be admitted"),  # was a RuntimeError: livelock
        (["accuracy", "--context", "2000000000"], r"--batch 4, --context 2000000000, --heads 32,8,128: needs .* this host"),
        (["serve", "--arrivals-only", "--arrivals-requests", "0"], "--arrivals-only with --arrivals-requests 0 measures nothing"),
        (["serve", "--arrivals-only", "--batch", "2"], "--batch has no effect with --arrivals-only"),
        (["serve", "--new-tokens", "8"], "--new-tokens 8 leaves 7 decode steps, fewer than the 16 the timing needs"),
        # was a StatisticsError (no decode-only iteration of generate's to time) after a minute of work:
        (["serve", "--new-tokens", "9", "--chunk", "1"], "--new-tokens 9 leaves 8 decode steps, fewer than the 9"),
        (["serve", "--prompt-len", "2"], "--prompt-len 2: at least 3"),
        (["serve", "--prompt-len", "500"], "--prompt-len 500 \\+ --new-tokens 128 = 628 tokens exceed the tiny model's"),
        (["serve", "--arrivals-long-len", "500"], "--arrivals-long-len 500, .* exceed the tiny model's max_position_embeddings"),
        (["serve", "--cold-layers", "2000000000"], r"needs .* --cold-layers 2000000000: weights"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else "",
)  # fmt: skip
def test_inconsistent_flags_are_usage_errors(argv, message, capsys):
    """Issue 37: flags that reached a traceback, were dropped without a word, or sized a run past
    its model, each refused before any work with a message naming the flag and the limit."""
    _is_usage_error(argv, message, capsys)


def test_bad_lengths_file(tmp_path, capsys):
    f = tmp_path / "bad.csv"
    f.write_text("prompt_len,output_len\n10,20\n10,abc\n")
    with pytest.raises(SystemExit) as exc:
        cli.main(["capacity", "--lengths", str(f)])
    assert exc.value.code == 2
    assert "bad.csv:3" in capsys.readouterr().err


def test_load_lengths_formats(tmp_path):
    csv = tmp_path / "a.csv"
    csv.write_text("# comment\nprompt_len,output_len,arrival\n10,20,0\n30,40,5\n")
    assert load_lengths(csv) == [(10, 20, 0), (30, 40, 5)]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"prompt_len": 7, "output_len": 9}\n{"prompt_len": 1, "output_len": 2, "arrival": 3}\n')
    assert load_lengths(jsonl) == [(7, 9, None), (1, 2, 3)]
    empty = tmp_path / "empty.csv"
    empty.write_text("prompt_len,output_len\n")
    with pytest.raises(WorkloadError):
        load_lengths(empty)
    bad = tmp_path / "bad.jsonl"
    for line, message in [
        ('{"prompt_len": 3.7, "output_len": 2}', "prompt_len must be a JSON integer, got 3.7"),  # was int(3.7) == 3
        ('{"prompt_len": true, "output_len": 2}', "prompt_len must be a JSON integer, got True"),
        ('{"prompt_len": 3, "output_len": 2, "arrival": "1"}', "arrival must be a JSON integer, got '1'"),
        ("5,7,99999999999", r"arrival in \[0, 2147483647\]"),
    ]:
        bad.write_text(line + "\n")
        with pytest.raises(WorkloadError, match=message):
            load_lengths(bad)


def test_synthetic_workload_is_seeded_and_bounded():
    a = synthetic(200, seed=1, rate=0.5, max_seq_len=512)
    b = synthetic(200, seed=1, rate=0.5, max_seq_len=512)
    assert a == b
    assert all(1 <= r.prompt_len and 1 <= r.output_len and r.total_len <= 512 for r in a.requests)
    arrivals = [r.arrival for r in a.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0


def test_first_fit_free_list():
    heap = FirstFit(100)
    a, b, c = heap.alloc(30), heap.alloc(30), heap.alloc(30)
    assert (a, b, c) == (0, 30, 60) and heap.alloc(20) is None and heap.free_tokens == 10
    heap.free(b, 30)
    assert heap.alloc(40) is None  # 30 + 10 free, not contiguous
    assert heap.extend(a, 30, 50) and heap.free_tokens == 20  # grows into b's old block
    heap.free(a, 50)
    heap.free(c, 30)
    assert heap.starts == [0] and heap.sizes == [100]  # coalesced back to one block
    with pytest.raises(AssertionError):
        heap.free(10, 5)  # double free
    rng = np.random.default_rng(0)
    live = {}
    for _ in range(300):
        if live and rng.random() < 0.5:
            start = rng.choice(list(live))
            heap.free(start, live.pop(start))
        elif (n := int(rng.integers(1, 20))) and (start := heap.alloc(n)) is not None:
            assert all(start + n <= s or s + m <= start for s, m in live.items())
            live[start] = n
        assert heap.free_tokens + sum(live.values()) == 100


def test_serve(tmp_path, capsys):
    """`arena-bench serve` on tiny settings (no depth sweep, no subprocess runs): figures consistent,
    run-ahead used, the same tokens as the reference loop, nothing compiled by the repeated calls."""
    # Batch 1, 20 + 12 tokens: generate's arena is test_prefix_progress.py's (2 pages of 16), compiled once per session.
    args = ["serve", "--batch", "1", "--prompt-len", "20", "--new-tokens", "12", "--rounds", "1", "--chunk", "2",
            "--layers", "--no-compile-cache-runs", "--cold-layers", "2", "--arrivals-requests", "0"]  # fmt: skip (2: the timed model)
    res = _run(args, tmp_path)["results"]
    assert res["arrivals"] is None
    s = res["step"]
    assert s["same_tokens_as_no_run_ahead"] is True and 0 < s["run_ahead_steps"] <= s["decode_calls"]
    for key in ("generate_step_ms", "generate_one_step_step_ms", "generate_no_run_ahead_step_ms", "bare_step_ms",
                "bare_public_step_ms", "bare_block_step_ms"):  # fmt: skip
        assert s[key] > 0
    assert s["bare_over_generate"] == pytest.approx(s["bare_step_ms"] / s["generate_step_ms"], rel=1e-2)
    assert s["bare_block_over_generate"] == pytest.approx(s["bare_block_step_ms"] / s["generate_step_ms"], rel=1e-2)
    assert s["decode_steps"] == 11 and s["decode_calls"] == 2 and s["one_step_decode_calls"] == 11  # 8 + 3 steps
    calls = res["compiles_per_call"]["calls"]
    assert calls[1]["programs_compiled"] == calls[2]["programs_compiled"] == 0  # (the cold call may find them compiled)
    assert res["compile_by_depth"] == [] and res["persistent_cache"] is None
    assert "bare/generate" in capsys.readouterr().out


def test_serve_arrivals():
    """The Poisson-arrival part of `arena-bench serve` on a tiny workload: every schedule gives
    the separate schedule's tokens, latencies are positive and ordered (p50 <= p99)."""
    from arena_jax.benchmarks.arrivals import ArrivalSettings, arrival_lines, measure_arrivals

    res = measure_arrivals(ArrivalSettings(requests=3, short_len=8, long_len=40, long_every=2, new_tokens=3, batch=2,
                                           chunk=16, chunks=(1,), rounds=1))  # fmt: skip
    assert [r["schedule"] for r in res["schedules"]] == ["separate", "mixed, budget 18"]
    for row in res["schedules"]:
        assert row["same_tokens"] is True
        for part in ("ttft", "itl"):
            assert 0 < row[part]["p50_ms"] <= row[part]["p99_ms"]
    assert res["arrival_rate_per_s"] > 0 and "TTFT p99" in "\n".join(arrival_lines(res))


@pytest.mark.parametrize("load", ["0", "nan", "-1", "inf", "11"])
def test_serve_refuses_a_bad_load(load, capsys):
    """Issue 37: `serve --arrivals-load 0` / `nan` ended in a traceback; a usage error now, before any work."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--arrivals-only", "--arrivals-load", load, "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"arena-bench serve: error: argument --arrivals-load: expected a finite number in (0, 10], got {load}" in err
    assert "Traceback" not in err


def test_speculative(tmp_path, capsys):
    """`arena-bench speculative`: prompt lookup and (--draft-layers) a draft model against plain
    decoding, alternated; the same greedy tokens in every mode."""
    res = _run(["speculative", "--requests", "2", "--span", "4", "--repeats-in-prompt", "3", "--new-tokens", "8",
                "--k", "2", "--draft-layers", "1", "--rounds", "1"], tmp_path)["results"]  # fmt: skip
    modes = [r["mode"] for r in res["rows"]]
    assert modes == ["plain, 1 step a call", "plain, decode blocks", "speculative, k=2", "draft 1/2 layers, k=2"]
    assert all(r["same_tokens"] and r["tokens_per_s"] > 0 for r in res["rows"])
    assert res["rows"][0]["acceptance"] is None and 0 <= res["rows"][3]["acceptance"] <= 1
    assert res["draft_speedup_vs_one_step"] > 0 and "draft model / plain" in capsys.readouterr().out
    # --damping 0: the target's second layer adds nothing, so its first layer (the draft) agrees
    # with it (up to float rounding between the two programs); undamped it agreed on 12%
    damped = _run(["speculative", "--requests", "2", "--span", "4", "--repeats-in-prompt", "3", "--new-tokens", "8",
                   "--k", "2", "--draft-layers", "1", "--damping", "0", "--rounds", "1"], tmp_path)["results"]  # fmt: skip
    assert damped["settings"]["damping"] == 0 and damped["rows"][3]["acceptance"] >= 0.9
    assert all(r["same_tokens"] for r in damped["rows"]) and "damped x0 (a synthetic pair)" in capsys.readouterr().out
