"""The model's layers compiled for the ``flex`` backend's static decode steps and full prefill chunks: the same
tokens and kept sets as the eager layers, one compiled graph shared by every layer, kvlab's own code never traced,
and every other forward eager. On a CPU the layers compile with a backend that records each graph and runs it as
traced (split as on a GPU, run by PyTorch's own kernels); the fused kernels' speed on a GPU is
``bench/heap_gpu.py``'s."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt, small_policy, tiny_model
from torch._dynamo.utils import counters

from kvlab.budget import Budget
from kvlab.engine.generation import Generation, generate
from kvlab.engine.spec import RunSpec
from kvlab.models.compiled import (
    CHUNK,
    CHUNK_MODE,
    EAGER,
    LAYER_MODE,
    STEP,
    compile_layers,
    compiled,
    decoder_layers,
    layer_stance,
)
from kvlab.models.loading import wrap_model


class Recorder:
    """A torch.compile backend that keeps the graphs it is given and runs them as traced."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.input_shapes: list[tuple[int, ...]] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append(graph)
        self.input_shapes += [tuple(value.shape) for value in example_inputs if isinstance(value, torch.Tensor)]
        return graph.forward


@pytest.fixture
def recorder():
    torch._dynamo.reset()
    counters.clear()
    yield Recorder()
    torch._dynamo.reset()


def run(loaded, ids, policy: str, attention: str):
    spec = RunSpec(
        small_policy(policy),
        Budget(tokens=14) if policy != "full" else None,
        mode="streaming" if policy != "full" else "prefill",
        chunk=7,
        max_new_tokens=8,
        stop_token_ids=(),
        static=True,
        attention=attention,
    )
    return generate(loaded, ids, spec)


@pytest.mark.long
@pytest.mark.parametrize("architecture", ["llama", "gemma2"])
def test_compiled_layers_decode_the_tokens_of_eager_layers_with_one_graph_for_all_layers(architecture, recorder):
    loaded = wrap_model(tiny_model(architecture))
    ids = prompt(batch=2, length=40, seed=5)
    policies = ("full", "streaming", "h2o", "tova")
    eager = {policy: run(loaded, ids, policy, "flex") for policy in policies}
    assert compile_layers(loaded.model, backend=recorder) and compiled(loaded.model)
    for policy in policies:
        fused = run(loaded, ids, policy, "flex")
        assert fused.tokens == eager[policy].tokens, policy
        assert fused.kept_per_layer == eager[policy].kept_per_layer, policy
    graph_breaks = [reason for reason in counters["graph_break"] if "disable" in reason]
    # split only where kvlab's code is called (the heap's write, the attention), never traced into
    assert graph_breaks and all("KVHeap.update" in reason or "kvlab_attention" in reason for reason in graph_breaks)
    traced = [node.target for graph in recorder.graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert traced and not any("kvlab" in getattr(target, "__module__", "") for target in traced)
    # a few graphs per stretch of a layer and shape (a step's, a prefill chunk's) whatever the layer's index, not a
    # set per layer
    assert 0 < len(recorder.graphs) <= 16
    # the query, key and value projections one product, the gate and up one: no stretch holds more than two (the
    # MLP's stacked gate and up, then its down projection), where each would hold three unpacked
    products = [sum(node.target is torch._C._nn.linear for node in graph.graph.nodes) for graph in recorder.graphs]
    assert max(products) == 2


def test_only_the_flex_backends_passes_run_the_compiled_layers(recorder):
    loaded = wrap_model(tiny_model("llama"))
    ids = prompt(batch=1, length=30, seed=3)
    compile_layers(loaded.model, backend=recorder)
    run(loaded, ids, "h2o", "sdpa")  # a prefill, static steps of another backend: nothing compiled
    with layer_stance(loaded.model, EAGER):
        loaded.model(input_ids=ids)
    assert recorder.graphs == []
    run(loaded, ids, "h2o", "flex")
    assert recorder.graphs


def test_the_flex_backends_full_prefill_chunks_run_the_compiled_layers_and_a_shorter_last_chunk_does_not(
    recorder, monkeypatch
):
    loaded = wrap_model(tiny_model("llama"))
    ids = prompt(batch=1, length=30, seed=3)  # four chunks of 7 tokens and one of 2
    eager = run(loaded, ids, "h2o", "flex")
    compile_layers(loaded.model, backend=recorder)
    chosen: list[tuple[int, bool, str]] = []
    choose = Generation.layer_forward

    def recorded(generation, tokens, decoding, heap):
        chosen.append((tokens, decoding, choose(generation, tokens, decoding, heap)))
        return chosen[-1][2]

    monkeypatch.setattr(Generation, "layer_forward", recorded)
    fused = run(loaded, ids, "h2o", "flex")
    assert fused.tokens == eager.tokens and fused.kept_per_layer == eager.kept_per_layer
    prefill = [(tokens, forward) for tokens, decoding, forward in chosen if not decoding]
    assert prefill == [(7, CHUNK)] * 4 + [(2, EAGER)]
    assert {forward for _, decoding, forward in chosen if decoding} <= {STEP, EAGER}
    hidden = loaded.model.config.hidden_size
    assert (1, 7, hidden) in recorder.input_shapes and (1, 2, hidden) not in recorder.input_shapes
    chosen.clear()
    run(loaded, ids[:, :13], "h2o", "flex")  # one full chunk and a shorter one: no chunk shape worth compiling
    assert [forward for tokens, decoding, forward in chosen if not decoding] == [EAGER, EAGER]


def test_a_model_without_a_list_of_decoder_layers_is_left_as_it_is():
    class Plain(torch.nn.Module):
        def forward(self, x):
            return x

    model = Plain()
    assert decoder_layers(model) == [] and not compile_layers(model) and not compiled(model)
    assert len(decoder_layers(tiny_model("llama"))) == 3


def test_inductor_autotunes_a_steps_products_and_another_backend_gets_no_mode(monkeypatch):
    asked: list[dict] = []

    def recording_compile(function, **options):
        asked.append(options)
        return function

    monkeypatch.setattr(torch, "compile", recording_compile)
    compile_layers(tiny_model("llama"))
    compile_layers(tiny_model("llama"), backend=Recorder())
    layers = len(decoder_layers(tiny_model("llama")))
    # a step's forward autotuned, a prefill chunk's with Inductor's defaults, per layer
    assert [options["mode"] for options in asked] == [LAYER_MODE, CHUNK_MODE] * layers + [None, None] * layers
    assert CHUNK_MODE is None
    assert "cudagraphs" in LAYER_MODE.split("-no-")  # Inductor's CUDA graphs would nest in the steps' own capture


def test_outside_kvlab_the_model_runs_its_own_eager_layers_after_a_fused_run(recorder):
    loaded = wrap_model(tiny_model("llama"))
    ids = prompt(batch=1, length=30, seed=3)
    with torch.no_grad():
        before = loaded.model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    compile_layers(loaded.model, backend=recorder)
    run(loaded, ids, "h2o", "flex")
    graphs = len(recorder.graphs)
    assert graphs and all("forward" not in vars(layer) for layer in decoder_layers(loaded.model))
    with torch.no_grad():  # a new length at every token: nothing compiles, the tokens are the eager ones
        after = loaded.model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert len(recorder.graphs) == graphs and torch.equal(after, before)
