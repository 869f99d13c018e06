import json

import pytest

from kvmesh import __version__
from support.processes import cli as run
from support.processes import mlx_lm_cli
from support.references import greedy_tokens

pytestmark = pytest.mark.slow  # every test runs the kvmesh command

PREFIX_KEYS = ("prefix_from", "prefix_tokens", "prefix_s", "wire_bytes", "cache_id", "skipped", "fetch_or_prefill")


def test_version():
    assert run("--version").stdout.strip() == f"kvmesh {__version__}"


def test_help_lists_commands():
    out = run("--help").stdout
    for command in ("model", "demo"):
        assert command in out
    assert "make-test" in run("model", "--help").stdout


def test_make_test_then_info(tmp_path):
    out = run("model", "make-test", str(tmp_path / "m"), "--preset", "tiny-qwen3").stdout
    assert "tiny-qwen3" in out
    info = json.loads(run("model", "info", str(tmp_path / "m"), "--json").stdout)
    assert info["model_type"] == "qwen3" and info["num_layers"] == 3


def test_usage_error_exits_2():
    result = run("model", "make-test", check=False)
    assert result.returncode == 2 and "usage:" in result.stderr


def test_make_test_into_non_empty_dir_fails_cleanly(tmp_path):
    (tmp_path / "x").write_text("x")
    result = run("model", "make-test", str(tmp_path), check=False)
    assert result.returncode == 1
    assert result.stderr.startswith(f"kvmesh: error: {tmp_path}: exists")


@pytest.mark.lan  # its daemons find each other over mDNS on loopback
def test_demo_runs_the_mesh_and_checks_itself():
    out = run("demo", "--steps", "4").stdout  # exits non-zero when a check fails
    text = " ".join(out.split())  # the console wraps long lines
    assert "found each other over mDNS" in text and "speak mutual TLS" in text
    assert "refused at the TLS handshake" in text and "refused: weights: the cache was made with other" in text
    assert text.count(" ok ") == 6 and "FAILED" not in text and "all checks passed" in text
    assert "fetch transform-coded from C (+ basis once)" in text


def test_cache_commands_round_trip_an_mlx_lm_file(tiny_dir, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("Rivers run to the sea, and the sea does not fill.")
    made = mlx_lm_cli(
        "cache_prompt",
        "--model",
        tiny_dir,
        "--prompt",
        prompt_file.read_text(),
        "--prompt-cache-file",
        tmp_path / "p.safetensors",
    )
    assert made.returncode == 0, made.stderr
    store = ["cache", "--store", str(tmp_path / "store")]
    out = run(
        *store,
        "import-mlx",
        str(tmp_path / "p.safetensors"),
        "--model",
        str(tiny_dir),
        "--prompt-file",
        str(prompt_file),
    ).stdout
    assert out.startswith("imported ")
    [entry] = json.loads(run(*store, "list", "--json").stdout)
    assert entry["method"] == "full" and entry["cuttable"]

    run(*store, "export", entry["cache_id"], str(tmp_path / "c.kvc"))
    other = ["cache", "--store", str(tmp_path / "other")]
    assert run(*other, "import", str(tmp_path / "c.kvc")).stdout.startswith(f"imported {entry['cache_id']}")
    run(*other, "export-mlx", entry["cache_id"], str(tmp_path / "back.safetensors"), "--model", str(tiny_dir))
    assert (tmp_path / "back.safetensors").stat().st_size > 0


def test_cache_import_of_a_missing_file_is_one_clear_line(tmp_path):
    result = run("cache", "--store", str(tmp_path / "s"), "import", str(tmp_path / "nope.kvc"), check=False)
    assert result.returncode == 1
    assert result.stderr == f"kvmesh: error: {tmp_path / 'nope.kvc'}: cannot read: No such file or directory\n"


def test_prompt_and_model_mistakes_are_reported_before_any_model_loads(tmp_path):
    missing = run("--data-dir", str(tmp_path), "generate", str(tmp_path / "no-model"), "--prompt", "hi", check=False)
    assert (missing.returncode, missing.stderr) == (
        1,
        f"kvmesh: error: {tmp_path / 'no-model'}: no such model directory\n",
    )
    no_file = run(
        "--data-dir", str(tmp_path), "prefill", "/any/model", "--file", str(tmp_path / "doc.txt"), check=False
    )
    assert no_file.returncode == 1 and "doc.txt: cannot read: No such file or directory" in no_file.stderr
    nothing = run("--data-dir", str(tmp_path), "prefill", "/any/model", check=False)
    assert nothing.stderr == "kvmesh: error: give a --file, a --prompt, or both\n"


def test_a_cache_from_mlx_lm_cache_prompt_serves_generate_chat(tiny, tiny_dir, tmp_path):
    document = "Rivers run to the sea, and the sea does not fill. Mountains stand where they stood."
    (tmp_path / "doc.txt").write_text(document)
    made = mlx_lm_cli(
        "cache_prompt", "--model", tiny_dir, "--prompt", document, "--prompt-cache-file", tmp_path / "p.safetensors"
    )
    assert made.returncode == 0, made.stderr
    data = ["--data-dir", str(tmp_path / "node")]
    run(*data, "cache", "import-mlx", str(tmp_path / "p.safetensors"), "--model", str(tiny_dir), "--prompt", document)
    out = json.loads(
        run(
            *data,
            "generate",
            str(tiny_dir),
            "--chat",
            "--file",
            str(tmp_path / "doc.txt"),
            "--prompt",
            " Where do rivers run?",
            "--max-tokens",
            "6",
            "--json",
        ).stdout
    )
    model, tokenizer = tiny
    cached = tokenizer.apply_chat_template([{"role": "user", "content": document}], continue_final_message=True)
    assert out["prefix_from"] == "local store" and out["prefix_tokens"] == len(cached)
    assert set(PREFIX_KEYS) <= set(out)  # the names the server's usage.kvmesh gives too
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": document + " Where do rivers run?"}], tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(cached) + full[len(tokenizer.decode(cached)) :] == full
    tokens = cached + tokenizer.encode(full[len(tokenizer.decode(cached)) :], add_special_tokens=False)
    assert out["prompt_tokens"] == len(tokens)
    assert out["tokens"] == greedy_tokens(model, tokens, 6)


def test_commands_that_read_a_model_take_a_repo_id_from_the_local_hub_cache(tiny_dir, tmp_path):
    """As `hf download` leaves a repo: models--ORG--NAME/snapshots/<commit>/ and refs/main."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--kvtest--tiny"
    shutil.copytree(tiny_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    hub = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    info = json.loads(run("model", "info", "kvtest/tiny", "--json", env=hub).stdout)
    assert (info["repo_id"], info["revision"]) == ("kvtest/tiny", commit)
    assert info["model_id"] == json.loads(run("model", "info", str(tiny_dir), "--json").stdout)["model_id"]
    missing = run("model", "info", "kvtest/other", env=hub, check=False)
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1
    assert "kvtest/other: no such model directory, nor a model in the local Hugging Face cache" in missing.stderr


@pytest.fixture
def short_context_model(tiny_dir, tmp_path):
    """The tiny model with a 64-token context (its config's max_position_embeddings)."""
    import shutil

    model = tmp_path / "short"
    shutil.copytree(tiny_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    return model


def test_a_prompt_longer_than_the_context_is_refused_by_every_command_and_nothing_is_stored(
    short_context_model, tmp_path
):
    long_prompt = "The river runs to the sea. " * 30  # well over 64 tokens
    data = tmp_path / "node"
    for command in ("prefill", "generate"):
        result = run(command, short_context_model, "--prompt", long_prompt, data_dir=data, check=False)
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("kvmesh: error: the prompt has ")
        assert "this model's context is 64: shorten the --file or --prompt" in result.stderr
    short = run(
        "generate",
        short_context_model,
        "--prompt",
        "The river",
        "--max-tokens",
        "80",
        "--no-mesh",
        data_dir=data,
        check=False,
    )
    assert short.returncode == 1 and "and 80 more were asked for (--max-tokens); this model's context is 64" in (
        short.stderr
    )
    assert json.loads(run("cache", "list", "--json", data_dir=data).stdout) == []
    fits = run(
        "generate", short_context_model, "--prompt", "The river", "--max-tokens", "4", "--no-mesh", data_dir=data
    )
    assert fits.returncode == 0


def test_a_mistyped_model_path_is_named_without_dialling_the_hub_and_a_cached_repo_id_loads(tiny_dir, tmp_path):
    """Online, with the Hub at a port where nothing listens: a dial would end in a ConnectError."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--kvtest--tiny"
    shutil.copytree(tiny_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    online = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_CACHE": str(tmp_path / "hub")}
    data = tmp_path / "node"
    for typo, why in (
        ("./modles/x", "no such model directory"),
        ("models/typo", "no such model directory, nor a model in the local Hugging Face cache"),
    ):
        for command in ("prefill", "generate"):
            result = run(command, typo, "--prompt", "hi", data_dir=data, env=online, check=False)
            assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
            assert result.stderr.startswith(f"kvmesh: error: {typo}: {why}") and "Connect" not in result.stderr
    assert "(if it is a repo id, `hf download models/typo` fetches it)" in result.stderr
    made = json.loads(run("prefill", "kvtest/tiny", "--prompt", "hi there", "--json", data_dir=data, env=online).stdout)
    [entry] = json.loads(run("cache", "list", "--json", data_dir=data).stdout)
    assert entry["cache_id"] == made["cache_id"] and entry["model"].startswith("kvtest/tiny")


def test_a_prefill_outside_a_terminal_says_how_far_it_is_in_plain_lines(tiny_dir, tmp_path):
    """stderr a pipe (as under `| tee`): no bar is drawn, so lines say it, each tenth or so and at the end."""
    import re
    from importlib import resources

    document = tmp_path / "doc.txt"
    document.write_text(resources.files("kvmesh").joinpath("data/corpus.txt").read_text())  # ~1,750 tokens
    made = run("prefill", tiny_dir, "--file", document, "--json", data_dir=tmp_path / "node")
    tokens = json.loads(made.stdout)["tokens"]
    assert tokens > 3 * 512  # prefilled in steps of 512
    lines = made.stderr.splitlines()
    done = [
        re.fullmatch(
            rf"prefill: ([\d,]+) of {tokens:,} tokens \((\d+)%\), [\d,]+ tokens/s(, about [\d,]+ s left)?", line
        )
        for line in lines
    ]
    assert all(done), lines
    counts = [int(m[1].replace(",", "")) for m in done if m]
    assert len(counts) >= 4 and counts == sorted(counts) and counts[-1] == tokens


def test_a_data_dir_that_is_a_file_is_one_clear_line_for_every_command(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory")
    for given in (a_file, a_file / "sub"):
        for command in (["status"], ["cache", "list"], ["daemon", "--no-discovery", "--port", "0"]):
            result = run(*command, data_dir=given, check=False)
            assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
            assert result.stderr.startswith(f"kvmesh: error: data directory {given} ") and "Errno" not in result.stderr
            assert f"{a_file}, which is a file" in result.stderr if given != a_file else " is a file" in result.stderr
    config = tmp_path / "config.toml"
    config.write_text(f"data_dir = {str(a_file)!r}\n")
    from_file = run("daemon", "--config", config, "--no-discovery", "--port", "0", check=False)
    assert from_file.returncode == 1 and from_file.stderr.startswith(
        f"kvmesh: error: data directory {a_file} is a file"
    )


def test_cache_list_names_a_model_by_the_directory_it_was_loaded_from(tiny_dir, tmp_path):
    model_id = json.loads(run("model", "info", tiny_dir, "--json").stdout)["model_id"]
    data = tmp_path / "node"
    run("prefill", tiny_dir, "--prompt", "Rivers run to the sea.", data_dir=data)
    assert f"  {tiny_dir.name} ({model_id[:8]})  " in run("cache", "list", data_dir=data).stdout
    [entry] = json.loads(run("cache", "list", "--json", data_dir=data).stdout)
    assert entry["model"] == f"{tiny_dir.name} ({model_id[:8]})"
    # A Mac that never loaded the model names it by its type, as the manifest does.
    [elsewhere] = json.loads(run("cache", "list", "--json", "--store", data / "store", data_dir=tmp_path / "b").stdout)
    assert elsewhere["model"] == f"llama ({model_id[:8]})"


def test_generate_outside_a_terminal_says_how_far_its_prefill_is_in_plain_lines(tiny_dir, tmp_path):
    import re
    from importlib import resources

    document = tmp_path / "doc.txt"
    document.write_text(resources.files("kvmesh").joinpath("data/corpus.txt").read_text())
    made = run("generate", tiny_dir, "--file", document, "--max-tokens", "1", "--no-mesh", data_dir=tmp_path / "n")
    lines = [line for line in made.stderr.splitlines() if line.startswith("prefill: ")]
    [total] = {int(n.replace(",", "")) for n in re.findall(r"^prefill: [\d,]+ of ([\d,]+) tokens", made.stderr, re.M)}
    assert lines and lines[-1].startswith(f"prefill: {total:,} of {total:,} tokens (100%), "), made.stderr
    assert f"prefill of the remaining {total} tokens: " in made.stderr
