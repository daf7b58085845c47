"""A sharded checkpoint of chapter 07, saved in any layout, as a Hugging Face
`transformers` folder: `model.safetensors`, `config.json` and the tokenizer.

    python -m tools.export outputs/run1 outputs/run1-hf      # the run's newest checkpoint
    python -m tools.export outputs/run1/checkpoints/step-00000100 outputs/run1-hf

Then, with transformers installed (`pip install -e ".[test]"`), offline:

    from transformers import AutoTokenizer, LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained("outputs/run1-hf")

How: the checkpoint's `.metadata` lists every tensor (its whole shape and dtype) and
where its pieces lie, whoever wrote them. One process asks DCP for each weight whole
(`dcp.load(..., no_dist=True)`: no process group; DCP reads the pieces of every rank's
file and glues them) and writes them under transformers' names: chapter 01's model is
transformers' Llama (RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU, an
untied head), its parameters named alike with `model.` in front, the head excepted.
The checkpoint carries its model's shape and its tokenizer (written beside the shards
when it was saved), so nothing else is needed. The folder is written whole, then
renamed into place: an existing OUT is never touched.

This process holds the whole model (once, in the checkpoint's dtype, then once more
as it is written): export on a machine with the memory for it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from common.cli import Parser, one_of
from common.errors import UsageError, fail, run_main
from common.files import fsync_dir, fsync_write, verify_manifest

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# safetensors' names of the dtypes (https://huggingface.co/docs/safetensors: the format)
SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float64: "F64"}


def checkpoint_folder(text: str) -> Path:
    """A step-N folder, its `checkpoints` folder (the one `latest` names) or a run folder."""
    path = Path(text)
    for folder in (path, path / "checkpoints"):
        if (folder / "latest").is_file():
            return folder / (folder / "latest").read_text().strip()
    return path


def parse_args(argv=None):
    p = Parser(prog="python -m tools.export", description=__doc__.split("\n\n")[0])
    # (optional to argparse, so that a mistyped flag is named before a missing folder)
    p.add_argument("checkpoint", nargs="?", help="a checkpoint folder (step-N), or the run folder whose newest "
                                                 "it takes")
    p.add_argument("out", nargs="?", help="the transformers folder to write (must not exist, or be empty)")
    p.add_argument("--dtype", type=one_of(*DTYPES), default="fp32", help="the weights' dtype in the export")

    def check(args):
        if args.checkpoint is None or args.out is None:
            raise UsageError("name the checkpoint and the folder to write: python -m tools.export CHECKPOINT OUT")
        args.step_dir = checkpoint_folder(args.checkpoint)
        if not (args.step_dir / "manifest.json").is_file() or not (args.step_dir / ".metadata").is_file():
            raise UsageError(f"{args.checkpoint!r} is not a chapter 07 checkpoint (a step-N folder holding "
                             f"manifest.json and .metadata, or a run folder with checkpoints/latest)")
        out = Path(args.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise UsageError(f"{args.out!r} exists and is not an empty folder: nothing was written; "
                             f"choose another OUT")
    p.checks.append(check)
    return p.parse_args(argv)


def read_weights(step_dir: Path) -> tuple[dict, dict]:
    """(the model's config, {parameter name: the whole tensor}) from a checkpoint, in one
    process: every file checked against the manifest first."""
    try:
        verify_manifest(step_dir)
        config = json.loads((step_dir / "model.json").read_text())
    except (ValueError, OSError) as e:
        raise UsageError(f"checkpoint {step_dir} is damaged ({e}): nothing was exported") from None
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    weights = {key.removeprefix("model."): torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
               for key, meta in metadata.state_dict_metadata.items() if key.startswith("model.")}
    with warnings.catch_warnings():  # DCP notes that it runs without a process group: as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": weights}, checkpoint_id=step_dir, no_dist=True)  # every piece, glued in place
    return config, weights


def hf_name(name: str) -> str:
    """transformers' Llama name of a parameter of chapter 01's model."""
    return name if name == "lm_head.weight" else f"model.{name}"


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors format: 8 bytes (little-endian) giving the length of a JSON header,
    the header (each tensor's dtype, shape and byte range in what follows), then every
    tensor's bytes, in order. Nothing in it can run code when read."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors start 8-byte aligned

    def write(f):
        f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors.values():
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
    fsync_write(path, write)


def hf_config(config: dict, dtype: str) -> dict:
    """config.json of transformers' LlamaConfig for chapter 01's model."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"],
            "intermediate_size": config["intermediate_size"], "num_hidden_layers": config["num_hidden_layers"],
            "num_attention_heads": config["num_attention_heads"],
            "num_key_value_heads": config["num_key_value_heads"],
            "head_dim": config["hidden_size"] // config["num_attention_heads"],
            "max_position_embeddings": config["max_position_embeddings"], "rms_norm_eps": config["rms_norm_eps"],
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            # transformers 5 reads rope_parameters, 4.x rope_theta
            "rope_theta": config["rope_theta"],
            "rope_parameters": {"rope_type": "default", "rope_theta": config["rope_theta"]},
            "bos_token_id": config["bot_id"], "eos_token_id": config["eot_id"], "pad_token_id": config["pad_id"],
            "torch_dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype], "dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype]}


def tokenizer_config(config: dict) -> dict:
    """tokenizer_config.json: transformers' fast tokenizer around our tokenizers JSON."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config["max_position_embeddings"],
            "bos_token": config["bot_token"], "eos_token": config["eot_token"], "pad_token": config["pad_token"],
            "clean_up_tokenization_spaces": False}


def export(step_dir: Path, out: Path, dtype: str = "fp32") -> dict:
    """Write the transformers folder `out` from checkpoint `step_dir`; returns its config."""
    config, weights = read_weights(step_dir)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_safetensors(tmp / "model.safetensors",
                          {hf_name(n): w.to(DTYPES[dtype]) for n, w in sorted(weights.items())})
        for name, content in (("config.json", hf_config(config, dtype)),
                              ("generation_config.json", {"bos_token_id": config["bot_id"],
                                                          "eos_token_id": config["eot_id"],
                                                          "pad_token_id": config["pad_id"]}),
                              ("tokenizer_config.json", tokenizer_config(config))):
            fsync_write(tmp / name, lambda f, c=content: f.write(json.dumps(c, indent=2).encode() + b"\n"))
        shutil.copyfile(step_dir / "tokenizer.json", tmp / "tokenizer.json")
        fsync_dir(tmp)
        if out.is_dir():
            out.rmdir()  # empty (parse_args checked): replaced by the finished folder
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return config


def main(argv=None):
    args = parse_args(argv)
    try:
        config = export(args.step_dir, Path(args.out), args.dtype)
    except UsageError as e:
        fail(str(e))
    print(f"exported {args.step_dir} ({config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"vocabulary {config['vocab_size']}) to {args.out}: model.safetensors ({args.dtype}), config.json, "
          f"the tokenizer")


if __name__ == "__main__":
    run_main(main)
