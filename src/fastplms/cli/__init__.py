"""The `fastplms` command: build, verify and publish artifacts; embed datasets; generate proteins."""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time

from .. import __version__


def _progress_bar(stream=None):
    """A one-line TTY progress bar (records, residues/s, ETA); None when not on a terminal."""
    # Resolved per call, not at import: the bar must follow a redirected sys.stderr.
    stream = sys.stderr if stream is None else stream
    if not stream.isatty():
        return None
    start = time.perf_counter()

    def show(records: int, residues: int, total: int | None) -> None:
        elapsed = max(time.perf_counter() - start, 1e-9)
        rate = residues / elapsed
        if total:
            width = 30
            filled = int(width * records / total)
            eta = elapsed / max(records, 1) * (total - records)
            bar = "#" * filled + "." * (width - filled)
            line = f"[{bar}] {records}/{total} records  {rate:,.0f} res/s  ETA {eta:,.0f}s"
        else:
            line = f"{records} records  {rate:,.0f} res/s"
        stream.write("\r" + line.ljust(80))
        stream.flush()

    return show


def _cmd_embed(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModel

    kwargs = {"trust_remote_code": True}
    if args.backend:
        kwargs["attn_implementation"] = args.backend
    model = AutoModel.from_pretrained(args.model, **kwargs).eval()
    if args.device:
        model.to(torch.device(args.device))
    extra = {}
    if args.context:
        if "context" not in inspect.signature(model.embed_dataset).parameters:
            raise SystemExit(f"--context: {model.config.family} models take no retrieval context")
        extra.update(
            context=args.context,
            context_tokens=args.context_tokens or None,
            max_identity=args.max_identity,
            seed=args.context_seed,
            missing_context=args.missing_context,
        )
    bar = _progress_bar()
    start = time.perf_counter()
    result = model.embed_dataset(
        args.input,
        max_tokens_per_batch=args.max_tokens,
        batch_size=args.batch_size,
        max_length=args.max_length,
        pooling=tuple(p for p in args.pooling.split(",") if p),
        per_residue=args.per_residue,
        output=args.out,
        resume=args.resume,
        overwrite=args.overwrite,
        invalid=args.invalid,
        too_long=args.too_long,
        dtype=args.dtype,
        progress=bar,
        **extra,
    )
    seconds = time.perf_counter() - start
    if bar:
        sys.stderr.write("\n")
    print(f"model        {args.model} ({model.config.family}, {model.attention_backend()}, {args.dtype})")
    print(f"records      {result.num_records}" + (f" ({result.num_resumed} resumed)" if result.num_resumed else ""))
    print(f"residues     {result.num_residues}")
    print(f"time         {seconds:.1f} s")
    print(f"throughput   {result.num_residues / max(seconds, 1e-9):,.0f} residues/s")
    print(f"pooling      {', '.join(f'{k} {v.start}:{v.stop}' for k, v in result.pooling_slices.items()) or 'none'}")
    if result.skipped:
        print(f"skipped      {len(result.skipped)}: " + "; ".join(f"{i} ({why})" for i, why in result.skipped[:5]))
    if result.truncated:
        print(f"truncated    {len(result.truncated)}: {', '.join(result.truncated[:5])}")
    if result.duplicate_ids:
        print(f"duplicate ids {len(result.duplicate_ids)}: {', '.join(result.duplicate_ids[:5])} (all kept)")
    print(f"output       {result.output}")
    return 0


def _generation_bar(stream=None):
    """A one-line TTY progress bar over denoising steps of one batch; None when not on a terminal."""
    stream = sys.stderr if stream is None else stream
    if not stream.isatty():
        return None

    def show(batch: int, batches: int, step: int, steps: int) -> None:
        width = 30
        done = ((batch - 1) * steps + step) / (batches * steps)
        bar = "#" * int(width * done) + "." * (width - int(width * done))
        stream.write(f"\r[{bar}] batch {batch}/{batches} step {step}/{steps}".ljust(80))
        stream.flush()

    return show


def _generated_records(tokens, input_ids, vocabulary: tuple[str, ...], special: set[int]):
    """(sequence, non-residue count) per generated row: one character per position between `<cls>` and
    `<eos>`. The official sampler can emit `<unk>` and `<null_1>`; each is written as X (and counted)
    so that positions stay aligned with the template."""
    records = []
    for row, source in zip(tokens.tolist(), input_ids.tolist(), strict=True):
        chars = [vocabulary[t] for t, s in zip(row, source, strict=True) if s not in special]
        odd = sum(1 for c in chars if len(c) > 1 or not c.isalpha())
        records.append(("".join(c if len(c) == 1 else "X" for c in chars), odd))
    return records


def _cmd_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch
    from transformers import AutoModelForMaskedLM

    output = Path(args.out)
    if output.exists() and not args.overwrite:
        raise ValueError(f"{output} exists; pass overwrite=True to replace it")
    if args.num_seqs < 1 or args.batch_size < 1:
        raise ValueError(f"--num-seqs and --batch-size must be at least 1; received {args.num_seqs}, {args.batch_size}")
    if not args.length and args.template is None:
        raise ValueError("give --length (one or more) or --template")
    kwargs = {"trust_remote_code": True}
    if args.backend:
        kwargs["attn_implementation"] = args.backend
    model = AutoModelForMaskedLM.from_pretrained(args.model, **kwargs).eval()
    if not hasattr(model, "generate_inputs"):
        raise ValueError(f"{model.config.family} models do not generate sequences")
    if "template" not in inspect.signature(model.generate_inputs).parameters:
        raise ValueError(
            f"fastplms generate writes DPLM sequences; {model.config.family} generates structure tokens too: "
            "use model.generate_inputs and model.generate in Python (docs/dplm.md)"
        )
    if args.device:
        model.to(torch.device(args.device))
    lengths = [n for n in args.length or [len(args.template)] for _ in range(args.num_seqs)]
    model.generate_inputs(lengths, template=args.template)  # checked whole before any compute
    if args.steps < 1:
        raise ValueError(f"max_iter (--steps) must be a positive number of denoising steps; received {args.steps}")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(args.seed)
    batches = [lengths[i : i + args.batch_size] for i in range(0, len(lengths), args.batch_size)]
    special = {model.config.cls_token_id, model.config.eos_token_id, model.config.pad_token_id}
    bar = _generation_bar()
    records = []
    start = time.perf_counter()
    for number, batch in enumerate(batches, 1):
        input_ids, partial_masks = model.generate_inputs(batch, template=args.template)
        tokens = model.generate(
            input_ids.to(device),
            max_iter=args.steps,
            sampling_strategy=args.strategy,
            temperature=args.temperature,
            partial_masks=partial_masks.to(device),
            generator=generator,
            progress=None if bar is None else (lambda step, steps, n=number: bar(n, len(batches), step, steps)),
        )
        records += _generated_records(tokens.cpu(), input_ids, model.vocabulary, special)
    seconds = time.perf_counter() - start
    if bar:
        sys.stderr.write("\n")
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    with partial.open("w", encoding="utf-8") as handle:
        for index, (sequence, odd) in enumerate(records):
            about = f"length={len(sequence)} steps={args.steps} strategy={args.strategy} seed={args.seed}"
            about += f" nonresidue={odd}" if odd else ""
            handle.write(f">generated_{index} {about}\n{sequence}\n")
    partial.replace(output)
    print(f"model        {args.model} ({model.config.family}, {model.attention_backend()})")
    print(f"sequences    {len(records)}")
    print(f"time         {seconds:.1f} s")
    print(f"output       {output}")
    return 0


def _cmd_build(args: argparse.Namespace) -> int:
    from ..artifact.build import build, build_all

    if args.all:
        if not args.snapshots:
            raise SystemExit("--all needs --snapshots <root>")
        built = build_all(args.snapshots, args.out, allow_unpinned=args.allow_unpinned, force=args.force)
        for path in built:
            print(path)
        if not built:
            print(f"no snapshot folders named after a manifest checkpoint under {args.snapshots}", file=sys.stderr)
            return 1
        return 0
    if not args.model_id or not args.snapshot:
        raise SystemExit("usage: fastplms build <model-id> --snapshot <dir> [--out <dir>]")
    print(build(args.model_id, args.snapshot, args.out, allow_unpinned=args.allow_unpinned, force=args.force))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from ..artifact.verify import verify

    problems, report = verify(args.artifact)
    if report:
        print(json.dumps(report, indent=2))
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    if not problems:
        print(f"OK {args.artifact}: hashes match provenance; loads offline through every AutoClass")
    return 1 if problems else 0


def _cmd_publish(args: argparse.Namespace) -> int:
    from ..artifact.publish import publish

    return publish(args.artifact, args.repo, yes=args.yes)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastplms", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fastplms {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    embed = sub.add_parser("embed", help="embed a FASTA/.txt file with a model artifact or Hub id")
    embed.add_argument("input")
    embed.add_argument("--model", required=True, help="artifact directory or Hub id")
    embed.add_argument("--out", required=True, help="output: *.db/*.sqlite (SQLite) or a directory (safetensors)")
    embed.add_argument("--pooling", default="mean", help="comma-separated: mean,max,min,std,sum,cls,last")
    embed.add_argument("--per-residue", action="store_true", help="also store per-residue embeddings")
    embed.add_argument("--max-tokens", type=int, default=4096, help="padded tokens per batch")
    embed.add_argument("--batch-size", type=int, default=None, help="cap on records per batch")
    embed.add_argument("--max-length", type=int, default=None, help="residues per sequence")
    embed.add_argument("--backend", default=None, help="attention backend (default: sdpa)")
    embed.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    embed.add_argument("--device", default=None, help="torch device, e.g. cuda")
    embed.add_argument("--resume", action="store_true", help="continue an interrupted run")
    embed.add_argument("--overwrite", action="store_true", help="replace an existing output")
    embed.add_argument("--invalid", default="raise", choices=("raise", "skip"), help="bad characters / empty")
    embed.add_argument("--too-long", default="raise", choices=("raise", "skip", "truncate"))
    embed.add_argument(
        "--context",
        default=None,
        help="retrieval context (models that take one): a FASTA/A3M/.txt file shared by every record, "
        "or a directory of <id>.a3m / <id>.fasta files, one per record id",
    )
    embed.add_argument(
        "--context-tokens", type=int, default=8192, help="context token budget per record (0: none); default 8192"
    )
    embed.add_argument(
        "--max-identity", type=float, default=None, help="drop context sequences more identical to the query"
    )
    embed.add_argument("--context-seed", type=int, default=0, help="seed of the context sampling")
    embed.add_argument(
        "--missing-context", default="raise", choices=("raise", "none"), help="a record without a context file"
    )
    embed.set_defaults(func=_cmd_embed)

    generate = sub.add_parser("generate", help="generate protein sequences with a diffusion model (DPLM)")
    generate.add_argument("--model", required=True, help="artifact directory or Hub id")
    generate.add_argument("--out", required=True, help="output FASTA file")
    generate.add_argument("--length", type=int, action="append", help="residues per sequence (repeatable)")
    generate.add_argument("--num-seqs", type=int, default=1, help="sequences per length; default 1")
    generate.add_argument("--steps", type=int, default=100, help="denoising steps (max_iter); default 100")
    generate.add_argument("--strategy", default="gumbel_argmax", choices=("gumbel_argmax", "argmax", "vanilla"))
    generate.add_argument("--temperature", type=float, default=None, help="vanilla sampling temperature")
    generate.add_argument("--seed", type=int, default=0, help="random seed; default 0")
    generate.add_argument(
        "--template", default=None, help="residues to keep and '_' for positions to generate, e.g. MK____A__"
    )
    generate.add_argument("--batch-size", type=int, default=16, help="sequences generated together; default 16")
    generate.add_argument("--backend", default=None, help="attention backend (default: sdpa)")
    generate.add_argument("--device", default=None, help="torch device, e.g. cuda")
    generate.add_argument("--overwrite", action="store_true", help="replace an existing output")
    generate.set_defaults(func=_cmd_generate)

    build = sub.add_parser("build", help="build a remote-code artifact from an official snapshot")
    build.add_argument("model_id", nargs="?", help="checkpoint id or published name, e.g. esm2_8m or ESM2-8M")
    build.add_argument("--snapshot", help="local copy of the official checkpoint repository")
    build.add_argument("--out", help="output directory (default dist/hub/<PublishedName>)")
    build.add_argument("--all", action="store_true", help="build every checkpoint whose snapshot is present")
    build.add_argument("--snapshots", help="with --all: folder holding one snapshot folder per checkpoint")
    build.add_argument("--allow-unpinned", action="store_true", help="accept weights that differ from pinned hashes")
    build.add_argument("--force", action="store_true", help="replace an output folder that is not a previous build")
    build.set_defaults(func=_cmd_build)

    verify = sub.add_parser("verify", help="re-hash an artifact and load it in a fresh offline process")
    verify.add_argument("artifact")
    verify.set_defaults(func=_cmd_verify)

    publish = sub.add_parser("publish", help="upload a verified artifact to the Hub (dry run unless --yes)")
    publish.add_argument("artifact")
    publish.add_argument("--repo", required=True, help="target Hub repository, org/name")
    publish.add_argument("--yes", action="store_true", help="really upload")
    publish.set_defaults(func=_cmd_publish)
    return parser


# The embedding library's hints name keyword arguments; on the command line they are flags.
_FLAG_HINTS = {
    "overwrite=True": "--overwrite",
    "resume=True": "--resume",
    "invalid='skip'": "--invalid skip",
    "too_long='truncate'": "--too-long truncate",
    "too_long='skip'": "--too-long skip",
    "missing_context='none'": "--missing-context none",
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        message = str(exc)
        if args.command in ("embed", "generate"):
            for keyword, flag in _FLAG_HINTS.items():
                message = message.replace(keyword, flag)
        print(f"fastplms {args.command}: error: {message}", file=sys.stderr)
        return 2
