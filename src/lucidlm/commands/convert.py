"""``lucidlm convert SOURCE OUT_DIR --to hf|lucidlm``: write a model in another format."""

from __future__ import annotations

import argparse
import time

from lucidlm.commands.generate import DTYPES, QUANTIZE_CHOICES
from lucidlm.errors import LucidLMError
from lucidlm.outputs import check_output_dir, writing

FORMATS = {"hf": "Hugging Face (config.json + model.safetensors + its tokenizer.json where it has one)",
           "lucidlm": "lucidlm (lucidlm_config.json + model.safetensors + tokenizer.json)"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert a model to Hugging Face or lucidlm format",
        description="Load a model from anything lucidlm can read and write it in another format.\n\n"
                    "--to hf      a directory transformers' AutoModelForCausalLM.from_pretrained loads:\n"
                    "             LLaMA-style models (RoPE, RMSNorm, SwiGLU) become LlamaForCausalLM,\n"
                    "             GPT-2-style models (learned positions, LayerNorm) become GPT2LMHeadModel;\n"
                    "             Qwen 2 / Qwen 3 models (read from Qwen folders or GGUF files) become\n"
                    "             Qwen2ForCausalLM / Qwen3ForCausalLM;\n"
                    "             interleaved-RoPE (GGUF-layout) Q/K rows are permuted to rotate_half;\n"
                    "             quantized weights (a GGUF file's, a lucidlm directory saved with --quantize)\n"
                    "             are written as the float matrices they stand for, in --dtype.\n"
                    "             Post-norm, sinusoidal and other non-HF configs are refused with the reason.\n"
                    "--to lucidlm lucidlm's own directory, which keeps every config field.",
        epilog="examples:\n"
               "  lucidlm convert smollm2-135m out/smollm2-hf --to hf\n"
               "  lucidlm convert path/to/hf-model out/mine --to lucidlm\n"
               "  lucidlm convert runs/shakespeare/checkpoint out/shakespeare-hf --to hf --dtype bfloat16",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", metavar="SOURCE",
                        help="what to convert: a pretrained name (smollm2-135m), a .gguf file, a Hugging Face "
                             "directory, a lucidlm model or checkpoint directory, or a preset name with --random-init")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (created if needed)")
    parser.add_argument("--to", dest="to_format", choices=sorted(FORMATS), required=True,
                        help="output format: " + "; ".join(f"{k} = {v}" for k, v in FORMATS.items()))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="dtype of the written weights (default: float32)")
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                        help="--to lucidlm only: store the weights quantized (int8 per channel, int4 in groups "
                             "of --group-size, or a GGUF file's own quantization); loads back quantized")
    parser.add_argument("--group-size", type=int, default=None,
                        help="with --quantize int4 or int8: the group size (int4: 32, 64, 128 or 256, default 32; "
                             "int8: one that divides the layers' widths, default per output channel)")
    parser.add_argument("--random-init", action="store_true",
                        help="SOURCE names an architecture preset (gpt2, llama, ...): build it untrained")
    parser.add_argument("--force", action="store_true",
                        help="write into OUT_DIR even if it already holds files: a model saved there before "
                             "(either format) is replaced, other files are kept")
    parser.add_argument("-q", "--quiet", action="store_true", help="no loading line on stderr")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from lucidlm.commands.generate import check_quantize_flags
    from lucidlm.commands.loading_status import LoadingStatus

    start = time.perf_counter()
    if args.quantize and args.to_format != "lucidlm":
        raise LucidLMError(f"--quantize {args.quantize} writes lucidlm's own format only: Hugging Face directories "
                           f"hold float weights. Use --to lucidlm, or drop --quantize.")
    check_quantize_flags(args)
    with LoadingStatus(f"loading {args.source}", enabled=not args.quiet):  # at once: the checks of OUT_DIR already import torch
        from lucidlm.commands.model_dir import refuse_unusable_output, refuse_writing_over, replacing_model

        out_dir = check_output_dir(args.out_dir, "OUT_DIR")  # before the model loads: a bad path costs no load
        refuse_writing_over(out_dir, args.source, "SOURCE", "OUT_DIR")  # --force or not
        refuse_unusable_output(out_dir, "OUT_DIR")  # a training run, or a directory named like a model file
        if out_dir.is_dir() and any(out_dir.iterdir()) and not args.force:
            raise LucidLMError(f"OUT_DIR {out_dir} is not empty; pick another directory or pass --force.")
        import torch

        from lucidlm.loading import load
        model = load(args.source, dtype=getattr(torch, args.dtype), quantize=args.quantize,
                     group_size=args.group_size, random_init=args.random_init)
    from lucidlm.quantization import dequantize
    from lucidlm.quantization.base import first_quantized, scheme_label

    held = first_quantized(model)  # a lucidlm directory saved with --quantize loads back quantized
    written_as = args.quantize or (scheme_label(held) if held is not None else args.dtype)
    if held is not None and args.to_format == "hf":
        # Hugging Face directories hold float weights: write the matrices the codes stand for,
        # as a quantized GGUF file is written (its blocks dequantized on load)
        dequantize(model, getattr(torch, args.dtype))
        written_as = f"{args.dtype}, dequantized from {scheme_label(held)}"
    with writing(out_dir, "OUT_DIR"), replacing_model(out_dir) as written:
        if args.to_format == "hf":
            from lucidlm.weights.hf import export_family, save_hf, SUPPORTED
            family = export_family(model.config)
            save_hf(model, out_dir)
            target = next(arch for arch, (fam, _) in SUPPORTED.items() if fam == family)
        else:
            from lucidlm.weights.checkpoint import save_model
            save_model(model, out_dir)
            target = "lucidlm"
    cfg = model.config
    files = ", ".join(written)
    print(f"converted {args.source} ({cfg.name}: {cfg.n_layers} layers, d_model {cfg.d_model}, "
          f"{model.num_parameters() / 1e6:.2f}M parameters, {written_as}) -> {out_dir} as {target} "
          f"[{files}] in {time.perf_counter() - start:.1f}s")
    return 0

