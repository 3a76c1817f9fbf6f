"""The meta-device memory trace (model/trace.py) and the planner recalibrated from it (issue 25)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from hidream_ui.model import trace
from hidream_ui.model.planner import activation_bytes, choose, sizes_from_configs
from hidream_ui.model.tiny.profiles import RELEASE_CONFIGS

GB = 10**9


def test_live_bytes_counts_creations_and_releases_exactly():
    lin1 = torch.nn.Linear(4, 8, device="meta")  # weights made before the mode: never counted
    lin2 = torch.nn.Linear(8, 2, device="meta")
    mode = trace.LiveBytes()
    with torch.no_grad(), mode:
        x = torch.empty(3, 4, device="meta")  # 48 B
        assert mode.current == 48
        h = lin1(x)  # + 96 (the weight's transposed view is no allocation)
        r = torch.relu(h)  # + 96
        assert mode.current == 240 and mode.peak == 240
        del h
        assert mode.current == 144
        y = lin2(r)  # + 24
        v = y.view(6)  # a view: same storage
        y.add_(1)  # in place: same storage
        assert mode.current == 168 and v.numel() == 6
        del x, r, v, y
        assert mode.current == 0 and mode.peak == 240
        mode.reset_peak()
        mode.workspace(1000)  # a kernel's transient workspace reaches the peak, never `current`
        assert mode.peak == 1000 and mode.current == 0


def test_attention_models_score_matrix_only_on_the_math_path():
    def run(strategy):
        with trace.traced(strategy) as mode:
            q, k, v = (torch.empty(1, 2, 16, 8, device="meta") for _ in range(3))  # 3 x 1024 B
            out = F.scaled_dot_product_attention(q, k, v)
            assert out.shape == (1, 2, 16, 8)
            return mode.peak

    # fused: q, k, v + the output; its log-sum-exp workspace (2 x 16 x 4 B) comes and goes before it.
    assert run("fused") == 4 * 1024
    # math: q, k, v + the scores (2 x 16 x 16 x 4 = 2048 B) + their softmax, both live at once.
    assert run("math") == 3 * 1024 + 2 * 2048
    assert F.scaled_dot_product_attention is not None and "sdpa" not in F.scaled_dot_product_attention.__name__
    with pytest.raises(ValueError, match="'nope'"):
        with trace.traced("nope"):
            pass


def _shallow_release():
    """The release's widths (so the per-token model applies) with 1 + 1 transformer blocks and 2-layer T5 and
    CLIPs (Llama keeps its 32 layers: the transformer's input holds every layer's hidden state): seconds on meta."""
    configs = {part: dict(value) for part, value in RELEASE_CONFIGS.items()}
    configs["transformer"].update(num_layers=1, num_single_layers=1)
    configs["transformer"]["llama_layers"] = [0, 1]  # one Llama layer per block
    configs["t5"]["num_layers"] = 2
    for clip in ("clip_l", "clip_g"):
        configs[clip]["num_hidden_layers"] = 2
    return configs


@pytest.fixture(scope="module")
def shallow():
    configs = _shallow_release()
    return configs, sizes_from_configs(configs), trace.build_parts(configs, torch.bfloat16, "e1.1")


@pytest.mark.slow
@pytest.mark.parametrize("side", [768, 1024])
def test_planner_prediction_within_10_percent_of_the_trace(shallow, side):
    configs, sizes, parts = shallow
    for strategy in trace.ATTENTION_STRATEGIES:
        phases = trace.trace_phases(parts, (side, side), torch.bfloat16, strategy)
        model = activation_bytes(sizes, (side, side), 2, attention=strategy)
        # The activation model alone (the weights add the same bytes to both sides)...
        assert 0.9 <= model["denoise"] / max(phases.denoise, phases.refine) <= 1.1, (strategy, side, phases)
        assert 0.9 <= model["decode"] / phases.decode <= 1.1, (strategy, side, phases)
        # ...and every plan's peak, both storages.
        rows = trace.plan_traces(sizes, phases, (side, side), 2)
        assert len(rows) == 10
        assert all(0.9 <= row.ratio <= 1.1 for row in rows), [(r.plan, r.weights, r.ratio) for r in rows]
    math_phases = trace.trace_phases(parts, (side, side), torch.bfloat16, "math")
    fused_phases = trace.trace_phases(parts, (side, side), torch.bfloat16, "fused")
    assert math_phases.denoise > 2 * fused_phases.denoise  # the score matrices dominate at these sizes


def test_host_ram_counts_for_fitting():
    sizes = sizes_from_configs(RELEASE_CONFIGS)
    common = dict(free=24 * GB, working_size=(1024, 1024), element=2)
    unchecked = choose(sizes, **common)
    assert any(row.fits and row.host > 23.5 * 2**30 for row in unchecked.rows)  # what issue 25 found
    checked = choose(sizes, host_free=int(23.5 * 2**30), **common)
    for row in checked.rows:
        if row.host > 23.5 * 2**30:
            assert row.fits is False and "host RAM" in row.note, row
    assert checked.chosen is None or checked.chosen.host_bytes <= 23.5 * 2**30
    roomy = choose(sizes, host_free=64 * GB, **common)
    assert roomy.chosen is not None and roomy.chosen.weights == "fp8"


def test_plan_command_host_memory_flag(capsys):
    from hidream_ui.cli.plan import main

    assert main(["--tiny-profile", "full", "--device-memory", "24GB", "--host-memory", "20GB", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["chosen"] is None and "host RAM" in report["refusal"]
    assert all(not row["fits"] for row in report["rows"] if row["host"] > 20 * GB)
