"""Fast checks of the committed trained checkpoints in checkpoints/trained (see tools/checkpoints/train_tiny_model.py)."""
from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import pytest
import torch

from tools.checkpoints import train_tiny_model as ttm

ROOT = Path(__file__).resolve().parents[2] / "checkpoints" / "trained"
TARGET, DRAFT = ROOT / "target", ROOT / "draft"
MAX_TOTAL_BYTES = 15 * 1024 * 1024

pytestmark = pytest.mark.skipif(
    not all(p.is_file() for p in (TARGET / "config.json", DRAFT / "config.json", ROOT / "README.md", ttm.HELDOUT_LIST)),
    reason="trained checkpoints not present (python -m tools.checkpoints.train_tiny_model --out checkpoints/trained)",
)


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def target():
    return _load(TARGET)


@pytest.fixture(scope="module")
def draft():
    return _load(DRAFT)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def heldout_ids(tokenizer) -> torch.Tensor:
    root = ttm.stdlib_root()
    rels = [line for line in ttm.HELDOUT_LIST.read_text().splitlines() if line and not line.startswith("#")]
    texts = [ttm.read_source(root / rel) for rel in rels if (root / rel).is_file()]
    if not texts:
        pytest.skip("held-out stdlib files are not available in this interpreter")
    ids: list[int] = []
    for text in texts:
        ids += [tokenizer.eos_token_id] + tokenizer(text).input_ids
        if len(ids) > 4 * ttm.SEQ_LEN + 1:
            break
    return torch.tensor(ids[: 4 * ttm.SEQ_LEN + 1])


def _loss(model, ids: torch.Tensor) -> float:
    windows = ids[:-1].reshape(-1, ttm.SEQ_LEN)
    targets = ids[1:].reshape(-1, ttm.SEQ_LEN)
    with torch.no_grad():
        logits = model(input_ids=windows).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()


def test_checkpoints_load_cleanly(target, draft):
    for model, info in (target, draft):
        assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        assert model.dtype == torch.float32
        assert type(model).__name__ == "LlamaForCausalLM"
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in draft[0].parameters()) * 2 < sum(p.numel() for p in target[0].parameters())


def test_files_and_size():
    total = 0
    for path in (TARGET, DRAFT):
        names = {p.name for p in path.iterdir()}
        assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
        generation = json.loads((path / "generation_config.json").read_text())
        assert generation["do_sample"] is False and generation["eos_token_id"] == generation["bos_token_id"]
        total += sum(p.stat().st_size for p in path.iterdir())
    assert total <= MAX_TOTAL_BYTES
    assert (ROOT / "README.md").is_file()


def test_tokenizer_round_trips_python(tokenizer):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    samples = [
        "def f(x, *args, **kw):\n    return {'a': x ** 2}  # comment\n",
        "class A(B):\n\tpass\n\n\n    x  =  'unicode: é ✓ 日本'\r\n",
        ttm.read_source(ttm.stdlib_root() / "os.py")[:4000],
    ]
    for text in samples:
        ids = tokenizer(text).input_ids
        assert raw.encode(text).ids == ids
        assert tokenizer.decode(ids) == text
        assert raw.decode(ids) == text
    assert tokenizer.bos_token == tokenizer.eos_token == tokenizer.pad_token == ttm.EOT


def test_draft_shares_tokenizer(target, draft):
    assert (TARGET / "tokenizer.json").read_bytes() == (DRAFT / "tokenizer.json").read_bytes()
    assert target[0].config.vocab_size == draft[0].config.vocab_size
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(target[0].config, key) == getattr(draft[0].config, key)


def test_heldout_loss_far_below_uniform(target, draft, heldout_ids):
    uniform = math.log(target[0].config.vocab_size)
    target_loss = _loss(target[0], heldout_ids)
    draft_loss = _loss(draft[0], heldout_ids)
    assert target_loss < 0.6 * uniform, (target_loss, uniform)
    assert draft_loss < 0.75 * uniform, (draft_loss, uniform)
    assert target_loss < draft_loss


def test_greedy_def_continuation_looks_like_python(target, tokenizer):
    ids = tokenizer("def ", return_tensors="pt").input_ids
    with torch.no_grad():
        out = target[0].generate(ids, max_new_tokens=32, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :])
    assert "(" in text and ":" in text, text
    assert len(set(out[0, ids.shape[1] :].tolist())) > 4, text


def test_split_is_disjoint_and_recorded():
    heldout = {ttm.stdlib_relative(p) for p in ttm.heldout_files()}
    training = {ttm.stdlib_relative(p) for p in ttm.training_files()}
    assert heldout and training and not heldout & training
    lines = ttm.HELDOUT_LIST.read_text().splitlines()
    if platform.python_version() not in lines[0]:
        pytest.skip(f"held-out list was recorded with another Python: {lines[0]}")
    assert heldout == {line for line in lines[1:] if line}


def test_chat_template_is_the_trainers_and_renders_like_transformers(tokenizer):
    """The committed checkpoints carry the trainer's chat template (a chat as Python comments, the reply opening a
    function), and the runtime renders it exactly as transformers' apply_chat_template does."""
    from runtime.request.chat import render_chat

    template = ttm.CHAT_TEMPLATE.read_text()
    assert (TARGET / "chat_template.jinja").read_text() == template == (DRAFT / "chat_template.jinja").read_text()
    messages = [{"role": "system", "content": "File helpers."}, {"role": "user", "content": "read a JSON file\nas a dict"},
                {"role": "assistant", "content": "def load(path):\n    return json.load(open(path))"},
                {"role": "user", "content": "now write it back"}]
    ours = render_chat(TARGET, messages)
    assert ours == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.startswith("# File helpers.\n# read a JSON file\n# as a dict\n") and ours.endswith("# now write it back\ndef ")
