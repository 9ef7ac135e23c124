"""tuning.train_graphs: each decoder layer's forward and backward replayed as a CUDA graph
(stages/rl/cuda_graphs.py).

Capturing needs a GPU (tests/test_gpu.py runs the captured layers against the eager ones through
DeepSpeed). Here, on CPU: the layer called as the capture calls it gives the model's own output, a
layer dispatches to its replay only for the captured shape with gradients on (a plain function
stands in for the replay: nothing can be captured without a GPU), the weight gradients that leave
a replay are copies, DeepSpeed's step keeps each parameter's storage (what a graph reads), and the
settings that cannot go with graphs are refused with the fix.
"""

import pytest
import torch

from jobs.check import check
from stages.rl import cuda_graphs, packing
from stages.runtime.config import ConfigError, load_config
from tests.test_train_batching import model_dir, step_gradients  # noqa: F401 (model_dir is a fixture)
from tests.workers.step_gradients import train_rows


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    from stages.rl.tiny_model import llama_config

    torch.manual_seed(0)
    dims = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128)
    m = AutoModelForCausalLM.from_config(llama_config(dims), dtype=torch.float32)
    packing.use_packed_attention(m)
    return m


def layer_io(model, batch) -> list:
    """Each decoder layer's (args, kwargs, output) in one forward of `batch`."""
    seen = []

    def record(module, args, kwargs, output):
        seen.append((args, kwargs, output))

    handles = [b.register_forward_hook(record, with_kwargs=True) for b in cuda_graphs.decoder_layers(model)]
    try:
        with torch.no_grad():
            model(input_ids=batch["input_ids"], **packing.model_kwargs(batch))
    finally:
        for h in handles:
            h.remove()
    return seen


def test_a_layer_called_as_the_capture_calls_it_gives_the_models_own_output(model):
    rows = train_rows(4, seed=1)
    shape = packing.fixed_shape([rows])
    batch = packing.pack(rows, torch.device("cpu"), shape)
    blocks = cuda_graphs.decoder_layers(model)
    assert len(blocks) == 3
    hidden, cos, sin, cu = cuda_graphs._layer_inputs(model, blocks[0], shape, "cpu")
    widths = cu.diff().tolist()
    assert hidden.shape == (1, shape.positions, 64) and len(widths) == shape.segments and cu[-1] == shape.positions
    assert 1 <= min(widths) and max(widths) <= shape.max_length
    # The model's layers on a real batch, then each called as the capture calls it, on the same
    # inputs, with aliases of its parameters as the capture passes them: the layer's own output,
    # and its weight gradients land on the aliases, not on the parameters (whose accumulators
    # DeepSpeed hooks).
    for block, (args, kwargs, output) in zip(blocks, layer_io(model, batch)):
        cos, sin = kwargs["position_embeddings"]
        names, params = zip(*block.named_parameters())
        call = cuda_graphs._layer_call(block, names, shape.max_length)
        aliases = [p.detach().requires_grad_() for p in params]
        got = call(args[0], cos, sin, kwargs["cu_seq_lens_q"], *aliases)
        assert torch.allclose(got, output, atol=1e-6)
        got.square().sum().backward()
        block(args[0], **kwargs).square().sum().backward()
        for name, p, a in zip(names, params, aliases):
            assert a.grad is not None and torch.allclose(a.grad, p.grad, atol=1e-5), name
            p.grad = None


def test_a_layer_replays_only_its_captured_shape_with_gradients_on(model):
    import copy

    m = copy.deepcopy(model)
    block = cuda_graphs.decoder_layers(m)[0]
    params = tuple(block.parameters())
    rows = train_rows(4, seed=2)
    shape = packing.fixed_shape([rows])
    args, kwargs, want = layer_io(m, packing.pack(rows, torch.device("cpu"), shape))[0]
    replays = []

    def replay(hidden, cos, sin, cu, *views):
        # A stand-in for the captured graph (no GPU here): the layer's own function, recorded.
        replays.append(views)
        return eager(hidden, **cuda_graphs.layer_kwargs(cos, sin, cu, shape.max_length))

    eager = block.forward
    block.forward = cuda_graphs._replaying_forward(eager, replay, args[0].shape, kwargs["cu_seq_lens_q"].shape,
                                                   shape.max_length, params)
    out = block(args[0].clone().requires_grad_(), **kwargs)
    assert len(replays) == 1 and torch.allclose(out, want, atol=1e-6)
    assert [v.data_ptr() for v in replays[0]] == [p.data_ptr() for p in params]  # the weights where they are
    with torch.no_grad():
        block(args[0], **kwargs)  # no gradients: the eager layer
    other = packing.pack(rows, torch.device("cpu"), (shape.positions + 64, shape.segments))
    a2, k2, _ = layer_io(model, other)[0]
    block(a2[0].clone().requires_grad_(), **k2)  # another shape: the eager layer
    assert len(replays) == 1
    cuda_graphs.release_layers(m)
    assert "forward" not in vars(block)
    block(args[0].clone().requires_grad_(), **kwargs)
    assert len(replays) == 1


def test_weight_gradients_leave_the_replay_as_copies():
    w = torch.nn.Parameter(torch.ones(3))
    buffer = torch.full((3,), 2.0)  # what a replay's gradient output would be: the graph's own buffer

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, weight):
            return weight * 1.0

        @staticmethod
        def backward(ctx, grad):
            return buffer

    (view,) = cuda_graphs._CopiedGradients.apply(w)
    assert view.data_ptr() == w.data_ptr()
    Replay.apply(view).sum().backward()
    assert w.grad.tolist() == [2.0, 2.0, 2.0] and w.grad.data_ptr() != buffer.data_ptr()
    buffer.fill_(7.0)  # the next replay overwrites its buffer: the gradient taken stays
    assert w.grad.tolist() == [2.0, 2.0, 2.0]


def test_capture_needs_a_gpu(model):
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; this rank runs on cpu"):
        cuda_graphs.capture_layers(model, (64, 3), torch.device("cpu"))
    with pytest.raises(ValueError, match="tuning.train_graphs=false"):
        cuda_graphs.decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_deepspeeds_step_keeps_every_parameter_where_a_graph_reads_it(tmp_path, model_dir):  # noqa: F811
    out = step_gradients(tmp_path, model_dir, 1, ["train.deepspeed_config=configs/ds_zero2_cpu.json"], "zero2")
    assert out["moved"] == []


def test_settings_that_cannot_go_with_graphs_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="tuning.remove_padding=true, or tuning.train_graphs=false"):
        load_config("configs/local_tiny.yaml", ["tuning.train_graphs=true", "tuning.remove_padding=false"])
    with pytest.raises(ConfigError, match="train.compile=eager, or tuning.train_graphs=false"):
        load_config("configs/local_tiny.yaml", ["tuning.train_graphs=true", "train.compile=inductor"])
    cfg = load_config("configs/local_tiny.yaml", ["tuning.train_graphs=true", "model.gradient_checkpointing=true",
                                                  "train.deepspeed_config=configs/ds_zero3_cpu.json"])
    problems = "\n".join(check(cfg, "local"))
    assert "uses ZeRO stage 3, which gathers each layer's weights" in problems
    assert "model.gradient_checkpointing" in problems and "set one of them to false" in problems
    assert check(load_config("configs/local_tiny.yaml", ["tuning.train_graphs=true"]), "local") == []


def test_train_on_a_rank_without_a_gpu_names_the_rank_and_the_fix():
    from types import SimpleNamespace

    from stages.train import check_graph_device, graph_layers

    ctx = SimpleNamespace(cfg=load_config("configs/local_tiny.yaml", ["tuning.train_graphs=true"]), rank=1)
    with pytest.raises(ConfigError, match="rank 1 runs on cpu: CUDA graphs need a GPU; set tuning.train_graphs=false"):
        check_graph_device(ctx, torch.device("cpu"))
    ctx.cfg.tuning.train_graphs = False
    check_graph_device(ctx, torch.device("cpu"))
    assert graph_layers(ctx, None, [], torch.device("cpu"), {}) is None
