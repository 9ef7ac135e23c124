"""CUDA graphs of the policy's decoder layers for train's update (tuning.train_graphs).

A small model's update is bound by the host: a step launches thousands of kernels, and the GPU
waits for them. Each layer's
forward and backward captured as a CUDA graph replays as one launch. A graph replays fixed tensor
shapes, so every micro-batch is packed to one shape (packing.fixed_shape, packing.pack's `shape`).

The module tree, the parameters and their gradients' path are untouched: the graphs read the
parameters where DeepSpeed keeps them (its optimizer step writes the same storage in place), and
each layer's weight gradients leave the graph as copies, so that DeepSpeed's gradient hooks and its
accumulation over micro-batches see ordinary tensors, not the graph's buffers that the next replay
overwrites. A forward of any other shape, or without gradients, runs the layer as before.
"""

from __future__ import annotations

import torch

from stages.rl.modeling import repeated_blocks
from stages.rl.packing import PackedShape

# Eager forward and backward passes of each layer before its capture: lazy initialisation (kernel
# loads, cuBLAS workspaces, autotuning) must not happen inside a capture, and one pass does all of it.
# make_graphed_callables' default of 3 only lengthens the capture (docs/benchmarks.md).
WARMUP_PASSES = 1


def capture_layers(model, shape: PackedShape, device) -> int:
    """Capture a forward and a backward graph for each decoder layer of `model` (an HF causal LM, its
    packed attention on: packing.use_packed_attention) at `shape` (packing.fixed_shape), and make the
    layers replay them; returns how many layers. The graphs share one memory pool and must run in the
    order a training step runs them: layers first to last, then backward last to first."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device; this rank runs on {device}")
    blocks = decoder_layers(model)
    shape = PackedShape(*shape)
    samples = _layer_inputs(model, blocks[0], shape, device)
    calls, args, params_of = [], [], []
    for block in blocks:
        names, params = zip(*block.named_parameters())
        params_of.append(params)
        calls.append(_layer_call(block, names, shape.max_length))
        hidden, cos, sin, cu = (x.detach().clone() for x in samples)
        # Aliases of the parameters (same storage, so a replay reads the weights in place), as new
        # leaves: the capture's backward must not reach the parameters' own gradient accumulators,
        # which DeepSpeed's ZeRO hooks keep alive on the default stream; the capture stream
        # cannot make that stream wait on it.
        args.append((hidden.requires_grad_(), cos, sin, cu) + tuple(p.detach().requires_grad_() for p in params))
    try:
        graphed = torch.cuda.make_graphed_callables(tuple(calls), tuple(args), num_warmup_iters=WARMUP_PASSES)
    except RuntimeError as e:  # an operation that cannot be captured (a host sync, a new allocation pattern)
        raise RuntimeError(f"tuning.train_graphs: capturing the {len(blocks)} {type(blocks[0]).__name__} layers at "
                           f"{shape.positions} positions failed ({e}); set tuning.train_graphs=false") from e
    for block, replay, call_args, params in zip(blocks, graphed, args, params_of):
        block.forward = _replaying_forward(block.forward, replay, call_args[0].shape, call_args[3].shape,
                                           shape.max_length, params)
    return len(blocks)


def release_layers(model) -> None:
    """The layers run eagerly again, and the graphs and their memory pool are freed (once nothing
    else holds them)."""
    for block in decoder_layers(model):
        block.__dict__.pop("forward", None)


def decoder_layers(model) -> list:
    """The model's decoder layers in the order its forward runs them."""
    return repeated_blocks(model, "tuning.train_graphs", "false")


def _layer_inputs(model, first_block, shape: PackedShape, device) -> tuple:
    """A real (hidden states, cos, sin, row offsets) of `shape` as the model hands them to its first
    layer, from one forward without gradients: their dtypes and shapes are whatever this model's
    embedding and rotary embedding make. The rows are of near-equal lengths, none longer than the
    shape's max_length (fixed_shape makes positions <= segments x max_length)."""
    seen = {}

    def record(module, args, kwargs):
        cos, sin = kwargs["position_embeddings"]
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.update(hidden=hidden, cos=cos, sin=sin, cu=kwargs["cu_seq_lens_q"])
        raise _Recorded

    positions, segments = shape.positions, shape.segments
    ids = torch.zeros(1, positions, dtype=torch.long, device=device)
    cu = torch.tensor([i * positions // segments for i in range(segments + 1)], dtype=torch.int32, device=device)
    handle = first_block.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=ids, position_ids=torch.arange(positions, device=device)[None], cu_seq_lens_q=cu,
                  cu_seq_lens_k=cu, max_length_q=positions, max_length_k=positions, use_cache=False)
    except _Recorded:
        pass
    finally:
        handle.remove()
    return seen["hidden"], seen["cos"], seen["sin"], seen["cu"]


class _Recorded(Exception):
    """Stops the sampling forward at the first layer: nothing past it is needed."""


def _layer_call(block, names: tuple, max_length: int):
    """The layer as a function of tensors only (what a graph captures), its parameters `names`
    taken from the arguments after the four inputs, so that the capture takes gradients with
    respect to those."""
    def call(hidden, cos, sin, cu, *params):
        return torch.func.functional_call(block, dict(zip(names, params)), (hidden,),
                                          layer_kwargs(cos, sin, cu, max_length))
    return call


def layer_kwargs(cos, sin, cu, max_length: int) -> dict:
    """What a decoder layer of a packed batch takes besides its hidden states."""
    return dict(attention_mask=None, position_embeddings=(cos, sin), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                max_length_q=max_length, max_length_k=max_length, use_cache=False)


class _CopiedGradients(torch.autograd.Function):
    """The parameters unchanged going forward; their gradients copied going backward (out of the
    graph's buffers, which the layer's next replay overwrites)."""

    @staticmethod
    def forward(ctx, *params):
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        return tuple(None if g is None else g.clone() for g in grads)


def _replaying_forward(eager, replay, hidden_shape, cu_shape, max_length: int, params: tuple):
    def forward(hidden_states, *args, position_embeddings=None, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        if (torch.is_grad_enabled() and cu is not None and position_embeddings is not None
                and kwargs.get("max_length_q") == max_length and hidden_states.shape == hidden_shape
                and cu.shape == cu_shape and not args):
            cos, sin = position_embeddings
            return replay(hidden_states, cos, sin, cu, *_CopiedGradients.apply(*params))
        return eager(hidden_states, *args, position_embeddings=position_embeddings, **kwargs)
    return forward
