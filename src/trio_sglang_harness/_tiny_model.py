"""A tiny local Llama model directory, built offline, for the real SGLang without a GPU.

SGLang's ``TokenizerManager`` insists on a model directory: it reads the model
config and loads the tokenizer (and its chat template) from it. Against the
stand-in scheduler the model never runs; the whole ``sglang.Engine`` on a CPU
runs its forward, hundreds of tokens a second for this one. Either way what
is tested is cancellation, not the words, so the smallest valid Llama will
do; building it here (a BPE tokenizer trained on a few sentences, a 2-layer
random-weight model with a fixed seed) keeps the tests off the network and
independent of any model hub.

torch, transformers and tokenizers are imported inside ``build_tiny_model`` so
that this module, and the harness package, import without the sglang extra.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = ["build_tiny_model"]

#: Written last, so its presence (with this content) means every other file is complete.
#: Bump the version when the recipe changes, so stale directories are rebuilt.
_MARKER = ".trio-sglang-tiny-model"
_MARKER_CONTENT = "trio-sglang tiny llama v3\n"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
_VOCAB_SIZE = 320
_POSITIONS = 8192
_SEED = 0
_CORPUS = (
    "hello world the quick brown fox jumps over the lazy dog",
    "a stream of tokens ends when it is finished or when it is cancelled",
    "user assistant system: what is the answer? the answer is forty two.",
    "0 1 2 3 4 5 6 7 8 9 , . ! ? ' \" ( ) [ ] { } - + = / * : ;",
)
#: The model's chat template, as a model's tokenizer config carries one: role
#: markers and an end-of-turn token (so that a prompt shows it was applied, unlike
#: the plain transcript), the generation prompt, and a refusal of its own, as
#: real templates raise (a conversation must not open with a tool's answer).
_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'tool' %}"
    "{{ raise_exception('a conversation cannot start with a tool message') }}"
    "{% endif %}"
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tiny_model(directory: Path) -> Path:
    """Build the tiny model in ``directory`` (unless it is already there) and return it.

    Idempotent and safe to race: files are written into a scratch directory next
    to the target and moved in one by one (each move is atomic), the marker last,
    so a reader never takes a half-written directory for a complete one, and two
    builders only ever replace a file with an identical one.
    """
    directory = Path(directory)
    if _is_complete(directory):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=directory.parent))
    try:
        _write_model(scratch)
        for item in sorted(scratch.iterdir()):
            item.chmod(0o644)  # some writers create 0600 files; the model is not a secret
            os.replace(item, directory / item.name)
        (directory / _MARKER).write_text(_MARKER_CONTENT)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return directory


def _is_complete(directory: Path) -> bool:
    """A directory is complete when the marker of this recipe and every model file exist."""
    marker = directory / _MARKER
    try:
        if marker.read_text() != _MARKER_CONTENT:
            return False
    except OSError:
        return False
    return all((directory / name).is_file() for name in _REQUIRED_FILES)


def _write_model(target: Path) -> None:
    """Write the tokenizer and the model files into ``target`` (an empty directory)."""
    tokenizer = _train_tokenizer()
    tokenizer.save_pretrained(str(target))
    _random_llama(tokenizer).save_pretrained(str(target))


def _train_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences.

    Byte-level with the full byte alphabet, so any text tokenizes without
    ``<unk>``; wrapped in ``PreTrainedTokenizerFast`` because that is what
    ``AutoTokenizer`` (and so SGLang) loads back from ``tokenizer.json``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    unk, bos, eos = _SPECIAL_TOKENS
    core = Tokenizer(models.BPE(unk_token=unk))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    # tokenizers and transformers are only partly typed: these ignores are for the checker
    # run with them installed; "unused-ignore" keeps the one without them quiet.
    trainer = trainers.BpeTrainer(  # type: ignore[no-untyped-call,unused-ignore]
        vocab_size=_VOCAB_SIZE,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(list(_CORPUS) * 10, trainer)
    tokenizer: PreTrainedTokenizerFast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
        tokenizer_object=core, bos_token=bos, eos_token=eos, unk_token=unk
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def _random_llama(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A 2-layer float32 ``LlamaForCausalLM`` with seeded random weights (about 0.5 MB)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # Room for long generations on the real engine: a request that is never
        # stopped then decodes for seconds, which nobody can mistake for a stop.
        max_position_embeddings=_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    # The default dtype is float32 and so are the weights (config.dtype only labels them).
    with torch.random.fork_rng(devices=[]):  # seed without disturbing the caller's generator
        torch.manual_seed(_SEED)
        model: LlamaForCausalLM = LlamaForCausalLM(config)  # type: ignore[no-untyped-call,unused-ignore]
    return model
