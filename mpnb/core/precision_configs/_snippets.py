"""The few lines a user writes to train a configuration's way in their own loop.

Every configuration's :meth:`~mpnb.core.precision_configs.PrecisionConfig.snippet` is built
here from one loop, so the snippets differ only where the configurations do: the set-up lines
before the loop, the context of the forward, the backward and the step. A snippet assumes three
names of the user's: ``model`` (an fp32 ``nn.Module`` on the device), ``batches`` (an iterable of
``(inputs, targets)`` on the device) and ``loss_fn(output, targets)``; running it trains one
epoch of ``batches``.

Example::

    >>> print(loop(["optimizer = torch.optim.SGD(model.parameters(), lr=0.1)"]))
    import torch
    <BLANKLINE>
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
    ...
"""

from __future__ import annotations

from collections.abc import Sequence

from mpnb.core.dtype_names import torch_name

__all__ = ["ASSUMES", "loop", "dtype_code", "amp_loop", "graph_loop"]

#: what every snippet expects to exist, said in its first line
ASSUMES = "# model: your fp32 model on {device}; batches: (inputs, targets) on it; loss_fn"

_AMP_BACKWARD = (
    "with amp.scale_loss(loss, optimizer) as scaled_loss:",
    "    scaled_loss.backward()",
)


def dtype_code(half: str) -> str:
    """``"torch.bfloat16"`` for ``"bf16"`` (any name of a dtype)."""
    return f"torch.{torch_name(half)}"


def loop(
    setup: Sequence[str],
    imports: Sequence[str] = (),
    context: str = "",
    backward: Sequence[str] = ("loss.backward()",),
    step: Sequence[str] = ("optimizer.step()",),
    device: str = "cpu",
) -> str:
    """The snippet: imports, ``setup`` lines, then the training loop.

    Args:
        setup: the lines before the loop (building the optimizer, wrapping the model).
        imports: import lines beyond ``import torch`` (empty ones are dropped).
        context: a ``with`` statement's expression the forward and the loss run in (``""``:
            none).
        backward, step: the loop's lines after the loss.
        device: named in the first comment.
    """
    head = ["import torch", *dict.fromkeys(i for i in imports if i)]
    forward = "loss = loss_fn(model(x), y)"
    body = ["optimizer.zero_grad(set_to_none=True)"]
    body += [f"with {context}:", f"    {forward}"] if context else [forward]
    body += [*backward, *step]
    lines = [
        ASSUMES.format(device=device.split(":")[0]),
        *head,
        "",
        *setup,
        "for x, y in batches:",
        *(f"    {b}" for b in body),
    ]
    return "\n".join(lines) + "\n"


def amp_loop(opt_level: str, half: str | None, optimizer: tuple[str, str], device: str) -> str:
    """mpnb's amp: ``amp.initialize`` at ``opt_level`` (in ``half``, a dtype name, or None for
    the level's own), the backward in ``amp.scale_loss``; ``optimizer`` is
    :func:`~mpnb.core.precision_configs._optimizers.optimizer_code`'s pair."""
    imp, make = optimizer
    half_kw = f", half_dtype={dtype_code(half)}" if half else ""
    init = f'model, optimizer = amp.initialize(model, optimizer, opt_level="{opt_level}"{half_kw})'
    return loop([make, init], ["from mpnb import amp", imp], backward=_AMP_BACKWARD, device=device)


def graph_loop(opt_level: str, half: str | None, optimizer: tuple[str, str], warmup: int) -> str:
    """mpnb's amp with the whole step captured in a CUDA graph (PyTorch's whole-network recipe:
    warm up on a side stream, capture once on static tensors, then copy each batch in and
    replay); ``optimizer`` must be a fused one (its step reads nothing on the host)."""
    imp, make = optimizer
    half_kw = f", half_dtype={dtype_code(half)}" if half else ""
    init = f'model, optimizer = amp.initialize(model, optimizer, opt_level="{opt_level}"{half_kw})'
    lines = [
        ASSUMES.format(device="cuda") + "; every batch the same shape",
        "import torch",
        "from mpnb import amp",
        *([imp] if imp else []),
        "",
        make,
        init,
        "",
        "def train_step(x, y):",
        "    loss = loss_fn(model(x), y)",
        *("    " + line for line in _AMP_BACKWARD),
        "    optimizer.step()",
        "    return loss.detach()",
        "",
        "batches = iter(batches)",
        "x, y = next(batches)",
        "static_x, static_y = x.clone(), y.clone()",
        "side = torch.cuda.Stream()",
        "side.wait_stream(torch.cuda.current_stream())",
        "with torch.cuda.stream(side):",
        f"    for _ in range({warmup}):  # eager steps first: lazy state",
        "        optimizer.zero_grad(set_to_none=True)",
        "        train_step(static_x, static_y)",
        "torch.cuda.current_stream().wait_stream(side)",
        "optimizer.zero_grad(set_to_none=True)",
        "graph = torch.cuda.CUDAGraph()",
        "with torch.cuda.graph(graph):",
        "    static_loss = train_step(static_x, static_y)",
        "for x, y in batches:",
        "    static_x.copy_(x)",
        "    static_y.copy_(y)",
        "    graph.replay()  # the whole step: forward, scaled backward, fused optimizer",
    ]
    return "\n".join(lines) + "\n"
