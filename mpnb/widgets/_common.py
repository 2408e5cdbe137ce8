"""Helpers shared by the widgets: callback errors shown in an ``Output``, hardware status text.

Nothing here measures or trains; it only formats what :mod:`mpnb.core` and :mod:`mpnb.lab`
return.
"""

from __future__ import annotations

import functools
import html
import traceback
from collections.abc import Callable

import ipywidgets as w
import plotly.graph_objects as go
import plotly.io as pio

from mpnb.core.hardware import cpu_info, cuda_info, half_support, status_of

__all__ = ["ErrorBox", "FigureOutput", "hardware_html", "half_status_label"]

_PLACEHOLDER = "<div style='padding:40px;color:#555'><b>{title}</b><br><i>{hint}</i></div>"


class ErrorBox(w.Output):
    """An ``Output`` that shows exceptions raised in widget callbacks, instead of the kernel log.

    Wrap a callback with :meth:`guard`; the last error's text is kept in :attr:`last_error`
    (tests read it).

    Example::

        >>> box = ErrorBox()
        >>> button.on_click(box.guard(run))
    """

    def __init__(self, **kw):
        kw.setdefault("layout", w.Layout(max_height="240px", overflow="auto"))
        super().__init__(**kw)
        self.last_error: str | None = None

    def show(self, exc: BaseException, context: str = "") -> str:
        """Render ``exc`` (with its traceback) in the box and return its one-line summary."""
        summary = f"{context}{type(exc).__name__}: {exc}"
        self.last_error = summary
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.append_display_data(
            w.HTML(
                f"<div style='color:#b00020'><b>{html.escape(summary)}</b></div>"
                f"<details><summary>traceback</summary><pre>{html.escape(tb)}</pre></details>"
            )
        )
        return summary

    def guard(self, fn: Callable) -> Callable:
        """Wrap ``fn`` so that an exception it raises is shown here (and not re-raised)."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - shown to the user, never lost
                self.show(e)
                return None

        return wrapper

    def clear(self) -> None:
        """Forget the shown errors (set directly: ``clear_output`` from a run's thread, or
        with no front end listening, was seen to leave the old error on screen)."""
        self.outputs = ()
        self.last_error = None


class FigureOutput(w.Output):
    """A plotly figure shown as a whole in an ``Output``: it renders whenever a view attaches.

    The figure is a plain ``go.Figure`` (:attr:`fig`) shown as plotly's own mime bundle, so
    the ``Output``'s state holds the whole figure: the chart appears after Run All, after a
    page reload, and whatever the order of display and update. ``FigureWidget`` views made
    before their page was shown were seen to render blank axes and to drop later updates.
    Until :meth:`render` is called (or after :meth:`placeholder`) it shows a line of text
    saying what to press instead of empty axes.

    Args:
        fig: the figure (updated in place by its owner, then :meth:`render` ed).
        title: the placeholder's heading.
        hint: the placeholder's instruction (e.g. "press Run").

    Example::

        >>> out = FigureOutput(go.Figure(), "loss scale", "press Step")
        >>> out.fig.add_scatter(x=[1, 2], y=[4, 8]); out.render()
    """

    def __init__(self, fig: go.Figure, title: str, hint: str, min_height: str = "340px"):
        super().__init__(layout=w.Layout(min_height=min_height))
        self.fig, self.title, self.hint = fig, title, hint
        self.rendered = False
        self.placeholder()

    def placeholder(self, hint: str | None = None) -> None:
        """Show the "nothing yet" text (``hint`` replaces the default instruction)."""
        text = _PLACEHOLDER.format(
            title=html.escape(self.title), hint=html.escape(hint or self.hint)
        )
        self.outputs = (dict(output_type="display_data", data={"text/html": text}, metadata={}),)
        self.rendered = False

    def render(self) -> None:
        """Show the figure as it is now (the whole figure: no earlier state is needed)."""
        bundle = pio.renderers["plotly_mimetype"].to_mimebundle(self.fig.to_plotly_json())
        self.outputs = (dict(output_type="display_data", data=bundle, metadata={}),)
        self.rendered = True


def half_status_label(dtype_name: str, device: str = "cpu") -> str:
    """``"bf16 (emulated)"``: the dtype with the device's native/emulated/unsupported status."""
    try:
        status = status_of(half_support(device), dtype_name)
    except KeyError:  # not a half dtype: no status to show
        return dtype_name
    return f"{dtype_name} ({status})"


def hardware_html(device: str = "cpu") -> str:
    """A short HTML summary of the device and its fp16/bf16 support, with a warning if emulated."""
    support = half_support(device)
    if str(device).startswith("cuda"):
        info = cuda_info() or {}
        name = f"{info.get('name', 'CUDA')} (capability {info.get('capability', '?')})"
    else:
        cpu = cpu_info()
        name = f"{html.escape(cpu.model)} ({cpu.arch}, kernels built for {cpu.isa})"
    rows = "".join(f"<tr><td>{k}</td><td><b>{v}</b></td></tr>" for k, v in sorted(support.items()))
    note = ""
    if "emulated" in support.values():
        note = (
            "<p style='color:#a05a00'>Emulated half dtypes are computed in software on this "
            "device and are much slower than fp32 (tens to over a hundred times for matmuls): "
            "on such hardware mixed precision saves memory, not time.</p>"
        )
    return (
        f"<p><b>Device:</b> {html.escape(str(device))} - {name}</p>"
        f"<table><tr><th>dtype</th><th>support</th></tr>{rows}</table>{note}"
    )
