"""Shared fixtures: tiny random models of every supported architecture, with a tokenizer;
heavy-tailed activation rows for the GPU kernel tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import optllm  # noqa: F401  (before any test imports transformers: drops this checkout from sys.path)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, every Triton kernel of the session runs on the CPU interpreter. Set here,
# before any test module imports triton (which reads it when a kernel is defined), so what
# a test runs does not depend on which files were collected first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (`make test` runs one worker a core) each worker, and the CLI subprocesses its tests start, runs
# one torch thread: workers of a thread a core each, not spinning OpenMP pools that outnumber the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

# Files to hand out first under `pytest -n 2 --dist loadfile`: the longest single test (the SmolLM2 AWQ end to end,
# about 200 s on one thread) collected last left one worker running it alone at the end of the run.
FIRST_FILES = ("tests/test_end_to_end.py",)


def pytest_collection_modifyitems(config, items):
    first = [it for it in items if it.nodeid.startswith(FIRST_FILES)]
    if first:
        items[:] = first + [it for it in items if not it.nodeid.startswith(FIRST_FILES)]


# An engine left in a reference cycle is freed by the cyclic collector, not when the test drops it, and the
# collector runs by object counts, blind to a 1 GiB CPU KV cache: a clean run grew to 24 GiB by
# test_spec_engine.py and was killed (thirty-ninth session). The runtime's own cycles (runner <-> speculative
# decoder <-> step graphs, the CPU stand-ins' runs) are weak references since the fortieth session
# (test_a_dropped_draft_engine_frees_its_kv_cache_without_the_cyclic_collector), but a test may still make one
# (a patched bound method stored on its own object). So after a test, collect when this process holds more
# than MEMORY_GUARD_GIB: reading the RSS costs microseconds, a collection ~0.1 s.
MEMORY_GUARD_GIB = 3.0


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def pytest_runtest_teardown(item, nextitem):
    if os.path.exists("/proc/self/statm") and _rss_gib() > MEMORY_GUARD_GIB:
        import gc

        gc.collect()


def tiny_tokenizer(vocab_size: int = 320, eos: str = "</s>", docs: int | None = 200):
    """A byte-level BPE tokenizer trained in-process on the built-in corpus (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from optllm.hub.corpus import builtin_texts

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(builtin_texts("calib")[:docs], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos)


def tiny_config(arch: str, vocab_size: int, hidden: int = 64, layers: int = 2):
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden + 64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=(arch == "llama"),
    )
    if arch == "qwen3":
        common["head_dim"] = hidden // 4
    cfg = AutoConfig.for_model(arch, **common)
    cfg.architectures = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                          "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    return cfg


def make_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tok), hidden, layers), dtype=torch.float32)
    # random init is near-zero for norms in some versions; give weights a realistic spread
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {a: make_tiny_model(root / a, a) for a in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture
def heavy_tailed_rows():
    """make(m, k, seed) -> (x, generator): x float32 [m, k] on CUDA, normal values scaled by
    2^[-20, 20) per row and 2^[-8, 8) per element, so row scales and in-row magnitudes both
    vary widely."""
    def make(m, k, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(m, k, device="cuda", generator=g)
        x *= torch.exp2(torch.randint(-20, 20, (m, 1), device="cuda", generator=g).float())
        x *= torch.exp2(torch.randint(-8, 8, (m, k), device="cuda", generator=g).float())
        return x, g
    return make


SPEC_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="session")
def tiny_chat(tiny_llama, tmp_path_factory):
    """A tiny random Llama with a chat template (speculative/: the Magpie path needs one)."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny-chat") / "llama-chat"
    shutil.copytree(tiny_llama, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = SPEC_CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return folder


def hf_float32(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def write_drafts(root: Path, target: Path) -> dict:
    """write_draft's three methods under root: Medusa and EAGLE (pass-through: their tokens are
    often accepted) and an EAGLE-3 with a 150-token draft vocabulary (random: it proposes noise)."""
    out = {m: write_draft(root / m, target, m) for m in ("medusa", "eagle")}
    out["eagle3"] = write_draft(root / "eagle3", target, "eagle3", seed=2, noise=0.3, draft_vocab=150)
    return out


def draft_vocab_ids(vocab_size: int, n: int):
    """write_draft's reduced EAGLE-3 vocabulary: the n lowest token ids, every third one skipped."""
    import torch

    return torch.tensor([i for i in range(vocab_size) if i % 3][:n])


def read_eagle3(folder: Path, hf, draft_vocab: int | None = None, aux_layers: tuple[int, ...] | None = None):
    """The training module's Eagle3Draft (speculative/eagle3.py) over hf with the weights write_draft
    (or an export of them) saved in folder: its reduced vocabulary set first where it had one."""
    from safetensors.torch import load_file

    from optllm.speculative.eagle3 import Eagle3Draft

    ref = Eagle3Draft.from_target(hf, aux_layers)
    if draft_vocab:
        ref.set_vocab(draft_vocab_ids(hf.config.vocab_size, draft_vocab))
    ref.load_state_dict(load_file(folder / "model.safetensors"))
    return ref


def write_draft(folder: Path, target: Path, method: str, seed: int = 0, noise: float = 0.02,
                draft_vocab: int | None = None) -> Path:
    """A draft as `optllm train-draft` writes it (config.json + model.safetensors) that proposes,
    up to noise, the target's own next token again: Medusa's untrained heads (zero residual
    blocks, the target's LM head), and an EAGLE layer that passes the feature through (fc picks
    the feature half, attention and MLP outputs zero). Random tiny models repeat tokens often
    enough for such drafts to be accepted, so the multi-token paths run."""
    import json

    import torch
    from safetensors.torch import save_file

    from optllm.hub.identity import target_identity
    from optllm.speculative.methods import DRAFT_METHODS

    hf = hf_float32(target)
    torch.manual_seed(seed)
    m = DRAFT_METHODS[method]
    draft = m.build(hf, 3)
    if draft_vocab is not None:
        draft.set_vocab(draft_vocab_ids(hf.config.vocab_size, draft_vocab))
    with torch.no_grad():
        if method == "eagle":
            h = draft.hidden_size
            draft.fc.weight.zero_()
            draft.fc.weight[:, h:] = torch.eye(h)
            draft.layers[0].self_attn.o_proj.weight.zero_()
            draft.layers[0].mlp.down_proj.weight.zero_()
        for p in draft.parameters():
            p.add_(noise * torch.randn_like(p))
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, folder / "model.safetensors")
    cfg = {"method": method, **m.config(draft), "dtype": "float32",
           "target": {"model": str(target), "sha256": target_identity(target), "architectures": []}}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture
def both_launch_paths(monkeypatch):
    """run(call, x): call(x) once through Triton's JITFunction.run and twice with kernels/common's
    direct launch on (a key's first call compiles through JITFunction.run, the second goes to the
    compiled launcher); asserts the three outputs bit-equal and returns the last."""
    from optllm.kernels import common

    def run(call, x):
        outs = []
        for direct in (False, True, True):
            monkeypatch.setattr(common, "DIRECT_LAUNCH", direct)
            outs.append(call(x))
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        return outs[2]

    return run
