"""Headless tests of CompareWidget: set the controls, click, assert on the DataFrame and figures."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from mpnb.core.hardware import half_support  # noqa: E402
from mpnb.lab import workloads  # noqa: E402
from mpnb.lab.html_report import CHART_TEXT  # noqa: E402
from mpnb.widgets import CompareWidget, compare  # noqa: E402


def _tiny():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, 0] > 0).long()
    return workloads.custom(
        lambda: torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
        ),
        (x, y),
        torch.nn.functional.cross_entropy,
        metric_fn=workloads.accuracy,
        metric_name="accuracy",
        lr=1e-2,
        batch_size=16,
        steps=6,
        name="tiny",
    )


@pytest.fixture(scope="module")
def finished():
    """One synchronous run, shared: O0 and O2 with a dynamic scaler set from the controls."""
    cw = CompareWidget(_tiny(), opt_levels=("O0",), steps=5, threaded=False, threads=1)
    cw.opt_levels.value = ("O0", "O2")
    cw.batch_sizes.value = "16"
    cw.scale_mode.value = "dynamic"
    cw.init_scale.value = 2.0**10
    cw.growth_interval.value = 1000
    cw.run_button.click()
    return cw


def test_run_fills_the_dataframe_and_the_verdict(finished):
    cw = finished
    assert cw.errors.last_error is None, cw.errors.last_error
    df = cw.df
    assert list(df["configuration"]) == ["O0 fp32 b16", "O2 bf16 b16"]
    assert (df["status"] == "ok").all() and (df["step_time_ms"] > 0).all()
    assert df.loc[1, "final_loss_scale"] == 2.0**10  # the widget's scaler settings were used
    hist = df.attrs["history"]
    assert set(hist["configuration"]) == set(df["configuration"])
    assert len(hist) == 2 * 5 and df.attrs["hardware"]["threads"] == 1  # the threads control
    assert cw.progress.value == cw.progress.max == 10 and cw.status.value.startswith("done")
    assert not cw.run_button.disabled and cw.stop_button.disabled
    assert cw.children[0] is cw.verdict  # the verdict is at the top
    assert df.attrs["verdict"]["recommendation"] in cw.verdict.value.replace("&#x27;", "'")


def test_figures_show_the_one_speed_figure(finished):
    cw, df, v = finished, finished.df, finished.views
    names = list(df["configuration"])
    bar = v.speed.data[0]
    labels = [a.text for a in v.speed.layout.annotations]
    assert list(bar.x) == names and labels == list(df["speed_label"])
    assert list(bar.y) == pytest.approx(list(df["speedup_vs_O0"]))
    for tr in v.memory.data:  # stacked bars: one trace per role
        role = tr.name.replace(" ", "_")
        assert list(tr.y) == pytest.approx(list(df[f"mem_{role}_mib"].fillna(0.0)))
    assert list(v.accuracy.data[0].y) == pytest.approx(list(df["metric"]))
    curves = {tr.name: tr for tr in v.loss_curves.data}
    assert set(curves) == set(names) and list(curves[names[1]].x) == [0, 1, 2, 3, 4]
    scale = {tr.name: tr for tr in v.loss_scale.data}
    assert list(scale[names[1]].y) == [2.0**10] * 5
    for name in names:
        assert name in cw.table.value
    assert df.loc[1, "speed_label"] in cw.table.value
    assert "bfloat16" in cw.hardware.value and "load average" in cw.hardware.value


def test_every_chart_has_title_units_and_how_to_read(finished):
    v = finished.views
    figs = dict(speed=v.speed, memory=v.memory, accuracy=v.accuracy)
    figs.update(loss=v.loss_curves, loss_scale=v.loss_scale)
    for name, fig in figs.items():
        title, _, y, how = CHART_TEXT[name]
        assert title in fig.layout.title.text and "How to read" in fig.layout.title.text
        assert fig.layout.xaxis.title.text and "(" in fig.layout.yaxis.title.text, name
    assert "MiB" in v.memory.layout.yaxis.title.text


def test_export_csv_and_html(finished, tmp_path):
    import pandas as pd

    finished.export_path.value = str(tmp_path / "out")
    finished.csv_button.click()
    finished.html_button.click()
    assert finished.export_errors.last_error is None, finished.export_errors.last_error
    back = pd.read_csv(tmp_path / "out.csv")
    assert list(back["configuration"]) == list(finished.df["configuration"])
    page = (tmp_path / "out.html").read_text()
    assert all(name in page for name in finished.df["configuration"])
    assert "Verdict" in page


def test_failing_configuration_is_shown_and_others_kept():
    cw = compare(
        _tiny(),
        opt_levels=("O0", "O3"),
        half_dtype="fp16",
        steps=4,
        threaded=False,
        loss_scale=2.0**24,
    )
    status = half_support("cpu")["float16"]  # measured: native on CPUs with AVX512-FP16
    assert cw.half_dtype.value == "fp16" and cw.half_dtype.options[1][0] == f"fp16 ({status})"
    cw.run_button.click()
    df = cw.df
    assert df.loc[0, "error"] == "" and "NaN divergence" in df.loc[1, "error"]
    assert df.loc[1, "error"].startswith("O3 fp16 b16")
    assert "O3 fp16 b16" in cw.config_errors.value and "failed" in cw.config_errors.value
    assert list(cw.views.speed.data[0].x) == ["O0 fp32 b16"]  # the failed row is not drawn


def test_stop_ends_within_one_step_and_keeps_the_rows():
    cw = compare(_tiny(), opt_levels=("O0", "O1", "O2", "O3"), steps=40, threads=1)
    seen = []

    def stop_after_a_few(change):
        seen.append(cw.progress.value)
        if cw.progress.value == 6 and not cw._stop.is_set():
            cw.stop_button.click()

    cw.progress.observe(stop_after_a_few, names="value")
    cw.run_button.click()
    assert cw.run_button.disabled and not cw.stop_button.disabled
    assert cw.join(timeout=300), "the run did not finish in 300 s"
    assert max(seen) == 6  # no step ran after Stop
    df = cw.df
    assert len(df) == 4 and (df["status"] == "interrupted").all() and df.attrs["stopped"]
    assert df["warnings"].str.contains("interrupted at step").all()
    assert cw.status.value.startswith("stopped") and not cw.run_button.disabled


def test_progress_names_configuration_step_and_eta(finished):
    cw = CompareWidget(_tiny(), opt_levels=("O0", "O2"), steps=4, threaded=False, threads=1)
    texts = []
    cw.status.observe(lambda c: texts.append(c["new"]), names="value")
    cw.run_button.click()
    steps = [t for t in texts if "step" in t and "ETA" in t]
    assert steps and "O2 bf16 b16: step 4/4" in " ".join(steps)


def test_bad_controls_are_shown_beside_them_and_block_run():
    cw = compare(_tiny(), steps=4, threaded=False)
    cw.batch_sizes.value = "16, zero"
    assert "batch sizes" in cw.control_errors["batch_sizes"].value and cw.run_button.disabled
    cw.batch_sizes.value = "16"
    for bad in (0, -5):
        cw.steps.value = bad
        assert "refused" in cw.control_errors["steps"].value and cw.run_button.disabled
    cw.steps.value = 4
    cw.opt_levels.value = ()
    assert "at least one" in cw.control_errors["opt_levels"].value and cw.run_button.disabled
    cw.run_button.click()  # a click anyway: refused, nothing runs
    assert "opt level" in cw.errors.last_error and cw.df is None
    cw.opt_levels.value = ("O0",)
    assert not cw.run_button.disabled and cw.control_errors["opt_levels"].value == ""
    cw.threads.value = 10_000
    assert "CPUs" in cw.control_errors["threads"].value and not cw.run_button.disabled
    cw.csv_button.click()  # nothing to export yet
    assert "press Run first" in cw.export_errors.last_error


def test_cnn_and_hf_model_through_the_widget():
    tr = pytest.importorskip("transformers")
    tr.utils.logging.set_verbosity_error()
    from mpnb.lab.hf import transformers_workload

    x = torch.randn(64, 1, 12, 12)
    cnn = lambda: torch.nn.Sequential(  # noqa: E731
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(400, 2)
    )
    cw = compare(
        cnn,
        (x, (x.mean((1, 2, 3)) > 0).long()),
        metric_fn=workloads.accuracy,
        opt_levels=("O0", "O2"),
        steps=3,
        threaded=False,
        threads=1,
    )
    assert cw.batch_sizes.value == "64" and cw.size.disabled is True  # the workload's own
    cw.run_button.click()
    assert (cw.df["status"] == "ok").all(), cw.df["error"].tolist()
    cfg = tr.GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    ids = torch.randint(0, 64, (32, 16))
    w = transformers_workload(lambda: tr.GPT2LMHeadModel(cfg), ids, batch_size=8)
    cw = compare(w, opt_levels=("O0", "O1", "O2", "O3"), steps=3, threaded=False, threads=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cw.run_button.click()
    assert (cw.df["status"] == "ok").all(), cw.df["error"].tolist()
    assert list(cw.df["opt_level"]) == ["O0", "O1", "O2", "O3"]
    assert cw.df["metric_name"][0] == "token accuracy" and cw.df["metric"].notna().all()
    assert not [c for c in caught if "backward hooks" in str(c.message)]


def test_charts_are_whole_figures_in_outputs_with_a_placeholder_before_run(finished):
    from mpnb.widgets._compare_views import ResultViews

    fresh = ResultViews()
    for out in fresh.outputs.values():
        assert "press Run" in out.outputs[0]["data"]["text/html"]
    bundle = finished.views.outputs["speed"].outputs[0]["data"]
    fig = bundle["application/vnd.plotly.v1+json"]
    labels = [a["text"] for a in fig["layout"]["annotations"]]
    assert labels == list(finished.df["speed_label"])
    assert "Speed vs O0" in fig["layout"]["title"]["text"]


def test_scaler_controls_refuse_bad_values_beside_them_and_follow_the_mode():
    cw = compare(_tiny(), steps=4, threaded=False)
    dynamic = (cw.init_scale, cw.growth_factor, cw.backoff_factor, cw.growth_interval)
    assert cw.scale_mode.value == "default"
    assert all(c.disabled for c in dynamic) and cw.static_scale.disabled
    cw.scale_mode.value = "static"
    assert all(c.disabled for c in dynamic) and not cw.static_scale.disabled
    cw.scale_mode.value = "dynamic"
    assert not any(c.disabled for c in dynamic) and cw.static_scale.disabled
    for control, bad, key in (
        (cw.growth_factor, 0.1, "growth_factor"),
        (cw.backoff_factor, 0.0, "backoff_factor"),
        (cw.backoff_factor, 1.5, "backoff_factor"),
        (cw.growth_interval, 0, "growth_interval"),
    ):
        good = control.value
        control.value = bad
        assert control.value == bad  # kept as typed, not clamped
        assert "must" in cw.control_errors[key].value or "need" in cw.control_errors[key].value
        assert f"{control.description} {bad:g}:" in cw.control_errors[key].value  # as typed
        assert cw.run_button.disabled
        control.value = good
        assert cw.control_errors[key].value == "" and not cw.run_button.disabled
    cw.growth_factor.value = 0.1
    cw.scale_mode.value = "default"  # the scaler controls are not used: nothing to refuse
    assert not cw.run_button.disabled


def test_custom_workload_batch_size_is_the_default_and_follows_the_workload():
    cw = compare(_tiny(), steps=4, threaded=False)
    assert cw.batch_sizes.value == "16"
    cw.workload.value = "mlp"
    assert cw.batch_sizes.value == str(workloads.get("mlp").batch_size)
    cw.workload.value = "tiny"
    assert cw.batch_sizes.value == "16" and cw.request()["batch_sizes"] == (16,)


def test_old_errors_clear_on_success_and_status_never_says_wrote_over_an_error(tmp_path):
    cw = compare(_tiny(), opt_levels=("O0",), steps=3, threaded=False, threads=1)
    cw.csv_button.click()  # nothing to export yet: an error
    assert "press Run first" in cw.export_errors.last_error
    assert cw.status.value.startswith("export failed") and "wrote" not in cw.status.value
    cw.run_button.click()
    assert cw.export_errors.last_error is None and cw.status.value.startswith("done")
    assert cw.export_errors.outputs == () and cw.errors.outputs == ()  # gone from the screen
    cw.export_path.value = str(tmp_path / "missing-dir" / "compare")
    cw.csv_button.click()  # a directory that does not exist: an error, not "wrote"
    assert cw.export_errors.last_error and "wrote" not in cw.status.value
    cw.export_path.value = str(tmp_path / "compare")
    cw.csv_button.click()
    assert cw.export_errors.last_error is None and cw.export_errors.outputs == ()
    assert cw.status.value == f"wrote {tmp_path}/compare.csv"


def _stopped_widget(stop_at: int) -> CompareWidget:
    """Two batch sizes, three opt levels, stopped after ``stop_at`` steps of the first."""
    cw = compare(_tiny(), opt_levels=("O0", "O1", "O2"), batch_sizes=(16, 32), steps=40, threads=1)

    def stop(change):
        if cw.progress.value == stop_at and not cw._stop.is_set():
            cw.stop_button.click()

    cw.progress.observe(stop, names="value")
    cw.run_button.click()
    assert cw.join(timeout=300), "the run did not finish in 300 s"
    return cw


def test_stop_keeps_every_configuration_and_gives_a_verdict_from_what_was_measured():
    cw = _stopped_widget(stop_at=3 * 10)  # ten rounds of b16: six timed
    df = cw.df
    assert cw.errors.last_error is None, cw.errors.last_error
    assert len(df) == 6 and list(df["batch_size"]) == [16] * 3 + [32] * 3  # none vanished
    b16, b32 = df[df["batch_size"] == 16], df[df["batch_size"] == 32]
    assert (b16["steps_done"] == 10).all() and (b32["steps_done"] == 0).all()
    assert (df["status"] == "interrupted").all()
    v = df.attrs["verdict"]["text"]
    assert "every configuration failed" not in v
    assert v.startswith("Verdict, interrupted after 10 of 40 steps: ")
    assert "(fewer steps than asked; intervals wider)" in v.splitlines()[0]
    assert "Not started (stopped first): O0 fp32 b32, O1 bf16 b32, O2 bf16 b32." in v
    assert "no held-out metric" in v
    assert "interrupted at 10 of 40 steps" in cw.table.value and "not started" in cw.table.value
    assert cw.status.value.startswith("stopped: 3 of 6 configurations interrupted at step 10")
    assert "3 of 6 not started" in cw.status.value
    # the charts draw the configurations that ran; the Accuracy tab says why it has no bars
    assert list(cw.views.speed.data[0].x) == list(b16["configuration"])
    acc = cw.views.outputs["accuracy"].outputs[0]["data"]
    assert "No held-out metric" in acc.get("text/html", "")


def test_stop_before_anything_was_measured_says_so():
    cw = _stopped_widget(stop_at=3)  # one round: warm-up only
    first = cw.df.attrs["verdict"]["text"].splitlines()[0]
    assert first.startswith("Verdict: interrupted after 1 of 40 steps: too little was measured")
    assert "every configuration failed" not in first


def test_verdict_without_a_metric_names_no_tolerance(finished):
    from mpnb.lab.verdict import verdict

    df = finished.df.copy()
    df.attrs = dict(finished.df.attrs)
    df["metric"], df["metric_vs_O0"], df["metric_name"] = float("nan"), float("nan"), "-"
    df.loc[1, ["speedup_vs_O0", "speedup_lo", "speedup_hi"]] = [1.5, 1.3, 1.7]
    df.loc[1, "speed_label"] = "1.50x faster than O0"
    text = verdict(df)["text"]
    assert "within" not in text and " - of O0" not in text
    assert "Fastest: O2 bf16 b16, 1.50x faster than O0 (no metric was measured" in text


def test_every_configuration_is_in_view_in_the_list():
    cw = compare(_tiny(), steps=4, threaded=False)
    assert cw.opt_levels.rows == len(cw.opt_levels.options) > 4  # FP8 and pure bf16 in view


def test_accuracy_chance_line_drawn_only_where_the_workload_knows_it(finished):
    from mpnb.widgets._compare_views import ResultViews

    how = finished.views.accuracy.layout.title.text
    assert "dashed" not in how and "chance" not in how  # no line promised in the title
    assert not finished.views.accuracy.layout.shapes  # a custom workload: no chance level
    df = finished.df.copy()
    df.attrs = dict(finished.df.attrs, workload=dict(finished.df.attrs["workload"], chance=0.5))
    views = ResultViews()
    views.update(df)
    (line,) = views.accuracy.layout.shapes
    assert line.y0 == line.y1 == 0.5 and line.line.dash == "dash"
    assert [a.text for a in views.accuracy.layout.annotations] == ["chance (random guess)"]


def test_every_error_sits_under_its_cause():
    cw = compare(_tiny(), steps=4, threaded=False)
    run_row, status, failed, run_errors, export_row, export_errors = cw.actions.children
    assert cw.run_button in run_row.children and status is cw.status
    assert failed is cw.config_errors and run_errors is cw.errors
    assert cw.csv_button in export_row.children and export_errors is cw.export_errors
    assert cw.children[-1] is cw.tabs  # nothing below the charts
    # each control's message under it, as wide as it (not squeezed beside it)
    for key, box in cw.control_errors.items():
        holder = next(
            c
            for col in cw.controls.children[0].children
            for c in col.children
            if isinstance(c, type(cw.actions)) and box in c.children
        )
        assert holder.children.index(box) == 1, key
    assert cw.controls.children[0].layout.flex_flow == "row wrap"


def test_the_peers_are_offered_and_each_row_shows_its_code_to_copy():
    cw = compare(_tiny(), steps=4, threaded=False, threads=1)
    assert {"torch-amp", "tf32", "torch-amp+compile"} <= set(cw.opt_levels.options)
    assert cw.opt_levels.value == ("O0", "O1", "O2", "O3", "torch-amp")  # compare's default
    assert "Code" in cw.tabs.titles and "After a run" in cw.code.value
    cw.opt_levels.value = ("O0", "O2", "torch-amp", "tf32")
    cw.run_button.click()
    assert cw.errors.last_error is None, cw.errors.last_error
    df = cw.df.set_index("opt_level")
    assert list(df.index) == ["O0", "O2", "torch-amp", "tf32"]
    assert df.loc["torch-amp", "status"] == "ok" and df.loc["tf32", "status"] == "unsupported"
    code = cw.code.value
    assert code.count("<pre><code>") == 4 and "torch-amp bf16 b16" in code
    assert "torch.autocast(&quot;cpu&quot;, dtype=torch.bfloat16)" in code
    assert "opt_level=&quot;O2&quot;" in code
    # tf32 is not a failure here: the device lacks it, and the line says where it runs
    assert "tf32 b16</b> not run: unsupported on cpu" in cw.config_errors.value
    assert "mpnb&#x27;s best" in cw.verdict.value  # the sentence against torch.amp
