"""Headless tests of mpnb.widgets.profile: the figures and panes show what mpnb.lab measured."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

import mpnb.lab  # noqa: E402
import mpnb.widgets  # noqa: E402


class Scale(torch.nn.Module):
    """Multiplies by a constant: past fp16's 65504 for ordinary activations."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), Scale(1e5), torch.nn.Linear(32, 4)
    )


@pytest.fixture(scope="module")
def pw():
    return mpnb.widgets.profile(
        _model(), torch.randn(8, 16), opt_levels=("O0", "O3"), half_dtype="fp16", steps=2, threads=1
    )


def test_phases_and_flops_figures_hold_the_lab_numbers(pw):
    from mpnb.widgets.profile_widget import _PHASE_NAMES

    res = pw.result
    assert set(res.phases["opt_level"]) == {"O0", "O3"}
    names = {v: k for k, v in _PHASE_NAMES.items()}
    for tr in pw.phases_fig.data:  # one stacked trace per phase
        got = res.phases[res.phases["phase"] == names[tr.name]]
        assert list(tr.x) == list(got["opt_level"])
        assert list(tr.y) == pytest.approx(list(got["time_ms"]))
    assert list(pw.flops_fig.data[0].y) == pytest.approx(list(res.flops["flop_per_s"] / 1e9))
    assert (res.flops["flops"] > 0).all()


def test_o0_has_no_unscale_phase_and_the_table_says_why(pw):
    ph = pw.result.phases
    assert "unscale_and_update" not in set(ph[ph.opt_level == "O0"].phase)
    assert "unscale_and_update" in set(ph[ph.opt_level == "O3"].phase)
    table = pw.tabs.children[0].children[1]
    assert "no loss scaler" in table.children[1].value


def test_charts_are_whole_figures_that_render_on_any_view(pw):
    for name in ("phases", "flops", "memory"):
        out = pw.views[name]
        assert out.rendered, name
        (bundle,) = out.outputs
        assert "application/vnd.plotly.v1+json" in bundle["data"], name


def test_memory_breakdown_and_its_failed_level(pw):
    mem = pw.memory.set_index("opt_level")
    params = pw.memory_fig.data[0]
    assert params.name == "params" and list(params.x) == ["O0"]  # O3 diverged in fp16
    assert params.y[0] == pytest.approx(mem.loc["O0", "mem_params_mib"]) and params.y[0] > 0
    assert "memory (O3 fp16" in pw.failures.value and "NaN" in pw.failures.value


def test_overflow_tracer_names_the_layer_and_links_to_the_precision_tab(pw):
    assert pw.trace.module == "2"
    pane = pw.tabs.children[5].children[0].value
    assert "module <b>2</b>" in pane and "fp16" in pane
    assert pw.precision_link in pw.tabs.children[5].children
    pw.precision_link.click()
    assert pw.tabs.selected_index == pw.TABS.index("Precision")


def test_precision_tab_shows_trace_precision_and_retraces(pw):
    assert pw.precision.summary.config == "O3"
    text = " ".join(c.value for c in pw.precision_view.children if hasattr(c, "value"))
    assert "O3" in text and "float16" in text and "ops recorded" in text
    pw.precision_config.value = "O1"
    pw.precision_button.click()
    assert pw.errors.last_error is None and pw.precision.summary.config == "O1"
    assert (pw.precision.ops["phase"] == "forward").any()


def test_load_and_threads_are_shown_and_competition_warns(pw):
    from mpnb.widgets.profile_widget import load_html

    load = pw.result.load
    assert load["threads"] == 1 and load["cpus"] >= 1
    assert "1 thread(s)" in pw.load.value and "load average" in pw.load.value
    busy = dict(load, competed=True, note="Warning: other processes competed for the CPU")
    assert "competed" in load_html(busy) and "#a05a00" in load_html(busy)


def test_threads_above_the_cores_warn():
    import os

    with pytest.warns(UserWarning, match="more than this machine"):
        mpnb.widgets.profile(
            _model(),
            torch.randn(8, 16),
            opt_levels=("O0",),
            steps=1,
            memory=False,
            trace=False,
            precision=None,
            threads=(os.cpu_count() or 1) + 1,
        )


def test_chrome_trace_export(pw, tmp_path):
    import json

    path = pw.export_chrome_trace(str(tmp_path / "o3.json"), "O3")
    events = json.load(open(path))["traceEvents"]
    assert any("addmm" in str(e.get("name", "")) for e in events)
    assert "wrote" in pw.trace_status.value
    with pytest.raises(ValueError, match="was not profiled"):
        pw.result.export_chrome_trace(str(tmp_path / "x.json"), "O2")


def test_threads_are_restored(pw):
    import torch as _t

    before = _t.get_num_threads()
    mpnb.widgets.profile(
        _model(),
        torch.randn(8, 16),
        opt_levels=("O0",),
        steps=2,
        memory=False,
        trace=False,
        precision=None,
        threads=1 if before != 1 else 2,
    )
    assert _t.get_num_threads() == before


def test_tuple_inputs_are_measured_and_skipped_extras_say_so():
    pw = mpnb.widgets.profile(
        _model(),
        (torch.randn(8, 16),),
        opt_levels=("O0",),
        steps=2,
        trace=False,
        precision=None,
        threads=1,
    )
    assert pw.failures.value == "" and pw.memory.peak_mem_mib.gt(0).all()
    assert "not run" in pw.tabs.children[5].children[0].value
    assert "not run" in pw.precision_view.children[0].value


def test_hf_tiny_model_through_profile_and_its_widget_under_every_level():
    import warnings

    tr = pytest.importorskip("transformers")
    tr.utils.logging.set_verbosity_error()
    from mpnb.lab.hf import hf_loss

    cfg = tr.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = tr.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    seen = set()

    def loss_fn(out):
        seen.add(type(out).__name__)
        return hf_loss(out)

    levels = ("O0", "O1", "O2", "O3")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pw = mpnb.widgets.profile(
            model,
            {"input_ids": ids, "labels": ids},
            loss_fn=loss_fn,
            opt_levels=levels,
            steps=1,
            threads=1,
        )
    assert pw.result.errors == {} and pw.failures.value == "", pw.failures.value
    assert set(pw.result.phases.opt_level) == set(levels)
    assert list(pw.memory.opt_level) == list(levels) and pw.memory.status.eq("ok").all()
    assert seen == {"CausalLMOutputWithCrossAttentions"}  # under every level, never a dict
    assert pw.precision.summary.config == "O1" and len(pw.precision.ops) > 0
    assert not [c for c in caught if "backward hooks" in str(c.message)]


def test_profile_reports_progress_per_level():
    seen = []
    mpnb.lab.profile(
        _model(),
        torch.randn(8, 16),
        opt_levels=("O0", "O1"),
        steps=1,
        warmup=0,
        on_progress=lambda level, done, total: seen.append((level, done, total)),
    )
    assert seen == [("O0", 0, 2), ("O1", 1, 2), (None, 2, 2)]


def test_profile_prints_no_kineto_usdt_lines():
    import subprocess
    import sys

    code = (
        "import torch, mpnb.lab\n"
        "m = torch.nn.Linear(4, 2)\n"
        "mpnb.lab.profile(m, torch.randn(3, 4), opt_levels=('O0',), steps=1, warmup=0)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "KINETO_LOG_LEVEL"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "USDT" not in out.stderr and "profiler_start" not in out.stderr


class _DictNet(torch.nn.Module):
    """Returns a dict, as many user and library models do."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(16, 4)

    def forward(self, x):
        return {"logits": self.body(x), "hidden": x}


def test_a_dict_returning_model_is_profiled_and_traced_like_compare_reads_it():
    pw = mpnb.widgets.profile(
        _DictNet(), torch.randn(8, 16), opt_levels=("O0", "O1"), steps=2, threads=1
    )
    assert "precision trace" not in pw.failures.value, pw.failures.value
    assert pw.precision is not None and pw.precision.summary.config == "O1"
    assert len(pw.precision.ops) > 0 and pw.trace is not None
    pw.retrace("O0")  # the Trace button reads the output the same way
    assert pw.errors.last_error is None and pw.precision.summary.config == "O0"


def test_precision_header_names_the_precision_never_a_dash(pw):
    pw.retrace("O0")
    head = pw.precision_view.children[0].value
    assert "(-," not in head and "cpu; Pure fp32 training" in head
    pw.retrace("O3")
    assert "(float16, cpu)" in pw.precision_view.children[0].value


def test_memory_table_has_a_column_per_level_and_a_row_per_role(pw):
    t = pw._memory_table()
    assert list(t.columns) == ["memory at the tracked step", "O0", "O3"]
    rows = list(t["memory at the tracked step"])
    assert rows[:2] == ["precision", "peak (MiB)"] and "params (MiB)" in rows


def test_the_widget_is_one_call_of_the_labs_profile(monkeypatch):
    """The widget re-did the lab's orchestration (device, half dtype, a workload for the
    memory run, the tracers); now one mpnb.lab.profile call measures all of it."""
    calls = []
    real = mpnb.lab.profile

    def recorded(*args, **kw):
        calls.append(kw)
        result = real(*args, **kw)
        calls.append(result)
        return result

    monkeypatch.setattr(mpnb.lab, "profile", recorded)
    x = torch.randn(8, 16)
    pw = mpnb.widgets.profile(_model(), x, opt_levels=("O0", "O1"), half_dtype="bf16", threads=1)
    kw, result = calls
    assert (kw["memory"], kw["trace"], kw["precision"], kw["threads"]) == (True, True, "auto", 1)
    assert pw.result is result and pw.memory is result.memory and pw.trace is result.overflow
    assert pw.precision is result.precision and result.precision.summary.config == "O1"
    assert list(result.memory.opt_level) == ["O0", "O1"] and result.half_dtype == torch.bfloat16


def test_precision_pictures_show_the_trace_map_and_what_if_statistics(pw):
    pw.retrace("O3")
    pics = pw.pictures
    assert pics in pw.precision_view.children  # above the tables
    assert pw.precision_view.children.index(pics) == 1
    assert pics.map_view.rendered and pics.stats_view.rendered
    (hm,) = pics.map_view.fig.data
    assert list(hm.colorbar.ticktext) == ["fp32", "fp16"] and {"0", "3"} <= set(hm.y)
    assert "O3" in pics.map_view.fig.layout.title.text
    # O3 has no recipe of its own: the statistics are the what-if chooser's, shown
    assert pw.stats.what_if and pics.what_if.layout.display is None
    assert (
        pics.what_if.value == "nvfp4" and "what-if nvfp4" in pics.stats_view.fig.layout.title.text
    )
    layers, tensors, values = pw.stats.heatmap("rel_err")
    assert layers == ["0", "3"] and [list(r) for r in pics.stats_view.fig.data[0].z] == values
    pics.what_if.value = "mxfp8"  # another format on the same tensors, recomputed
    assert pw.errors.last_error is None and pw.stats.what_if
    assert "mxfp8" in pw.stats.format and "what-if mxfp8" in pics.stats_view.fig.layout.title.text


def test_a_low_precision_configuration_shows_its_own_statistics_and_no_what_if(pw):
    with pytest.warns(UserWarning):  # the emulated FP4 GEMM says so
        pw.retrace("nvfp4")
    pics = pw.pictures
    assert pw.errors.last_error is None and not pw.stats.what_if
    assert pw.stats.format.startswith("nvfp4") and pics.what_if.layout.display == "none"
    assert "as this step quantized" in pics.stats_view.fig.layout.title.text
    (hm,) = pics.map_view.fig.data
    formats = list(hm.colorbar.ticktext)
    linear = [formats[int(z[0])] for y, z in zip(hm.y, hm.z, strict=True) if y in ("0", "3")]
    assert linear == ["nvfp4", "nvfp4"]  # the linear layers ran in NVFP4, emulated or not
    pw.retrace("O1")
    assert pw.stats.what_if and pics.what_if.layout.display is None


def test_no_label_of_the_precision_tab_is_cut_and_every_op_wraps_little(pw):
    # the Dropdown's default description width cut "configuration" to "configurat..."
    assert pw.precision_config.style.description_width == "initial"
    assert pw.pictures.metric.style.description_width == "initial"
    pw.retrace("O1")
    table = pw.precision_view.children[-1].value
    assert "<th>why</th>" not in table and "width:50%" in table  # the words get the room
    assert "<th>in dtypes</th>" not in table and "<th>dtypes</th>" in table


def test_without_the_model_the_statistics_say_why():
    pw0 = mpnb.widgets.ProfileWidget(
        mpnb.lab.profile(_model(), torch.randn(8, 16), ("O0",), steps=1)
    )
    assert not pw0.pictures.stats_view.rendered and pw0.stats is None
    assert "built without the model" in str(pw0.pictures.stats_view.outputs)
    assert pw0.errors.last_error is None
