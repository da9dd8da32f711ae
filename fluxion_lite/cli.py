"""The `fluxion-lite` command: pull, models, generate, chat, serve, calibrate, settings.

User errors (any FluxionError, or a file that cannot be read) print `error: <message>` on stderr and exit 2;
Ctrl-C exits 130 without a traceback. torch and the engine are imported only by the commands that run a model, so
`pull`, `models` and `settings` start instantly. The commands that run a model build one Settings
(fluxion_lite.settings) from the environment and their flags (`--set NAME=VALUE`, serve's `--api-key`) before
loading anything, and hand it to the engine.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxion_lite import __version__
from fluxion_lite.hub.catalog import cache_dir, catalog, default_model_name, get_model, list_models
from fluxion_lite.hub.resolve import resolve_model
from fluxion_lite.errors import FluxionError, RequestError
from fluxion_lite.plan import files as plan_files
from fluxion_lite.settings import FLAG, Settings, parse_assignments, reference_markdown

if TYPE_CHECKING:
    from fluxion_lite.engine.llm import LLM
    from fluxion_lite.engine.sampling import SamplingParams

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "gguf", "float32", "bfloat16", "float16")
EXIT_COMMANDS = ("/exit", "/quit", "/bye")


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-m", "--model", default=None, help=f"catalog name or path to a .gguf file (default: {default_model_name()})"
    )
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="where the model runs (default: auto, the GPU where torch sees one, else the CPU)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="gguf: the weights stay as the file stores them (4-8 bit blocks); auto (default): gguf on "
                             "the CPU, on CUDA bfloat16 where it fits, else gguf; a named dtype dequantizes every "
                             "weight to it")
    # No argparse choices: the engine owns the list of modes and rejects unknown ones before loading weights.
    parser.add_argument("--attention", default="auto",
                        help="auto (default): dense attention for short prompts, fluxion over the host KV for long "
                             "ones; or full, fluxion, fixed, full-host, gpu-sparse")
    parser.add_argument("--max-context", type=int, default=None, help="cap the context length (default: the model's)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--explain", action="store_true", help="print the sparse-attention plan after loading")
    parser.add_argument("--predictor", action="store_true",
                        help="fluxion: plan each request with the head-property predictor (experimental; default: "
                             "the calibrated static plan)")


def _add_settings_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="set_values", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for this run, over the environment: FLUXION_X=VALUE or its field name "
                             "(repeatable; `fluxion-lite settings` lists them)")


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    group.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: 0.8)")
    group.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens, 0 = off (default: 40)")
    group.add_argument("--top-p", type=float, default=None, help="nucleus sampling, 1 = off (default: 0.95)")
    group.add_argument("--min-p", type=float, default=None,
                       help="drop tokens below min-p x the top probability, 0 = off (default: 0.05)")
    group.add_argument("--repeat-penalty", type=float, default=None, help="llama.cpp repetition penalty (default: 1.0)")
    group.add_argument("--presence-penalty", type=float, default=None, help="OpenAI presence penalty (default: 0)")
    group.add_argument("--frequency-penalty", type=float, default=None, help="OpenAI frequency penalty (default: 0)")
    group.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop at TEXT (repeatable)")
    group.add_argument("--epsilon", type=float, default=None,
                       help="fluxion's error bound for this prompt: smaller reads more KV (default: the model's plan)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fluxion-lite", description="LLM inference with sparse attention over host-memory KV caches."
    )
    parser.add_argument("--version", action="version", version=f"fluxion-lite {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pull = commands.add_parser("pull", help="download a catalog model into the cache")
    pull.add_argument("name", nargs="?", default=None, help=f"catalog model name (default: {default_model_name()})")
    pull.add_argument("--force", action="store_true", help="download again even if present")
    pull.set_defaults(handler=cmd_pull)

    models = commands.add_parser("models", help="list catalog models and local .gguf files")
    models.set_defaults(handler=cmd_models)

    generate = commands.add_parser("generate", help="complete a prompt, streaming text to stdout")
    _add_model_options(generate)
    generate.add_argument("prompt", nargs="?", default=None, help="prompt text (or use --prompt-file)")
    generate.add_argument("-f", "--prompt-file", default=None, help="read the prompt from a file ('-' = stdin)")
    _add_settings_option(generate)
    _add_sampling_options(generate)
    generate.set_defaults(handler=cmd_generate)

    chat = commands.add_parser("chat", help="interactive multi-turn chat using the model's chat template")
    _add_model_options(chat)
    chat.add_argument("--system", default=None, help="system message")
    _add_settings_option(chat)
    _add_sampling_options(chat)
    chat.set_defaults(handler=cmd_chat)

    serve = commands.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    _add_model_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    serve.add_argument(
        "--api-key", default=None, help="require this bearer token (default: the setting FLUXION_API_KEY)"
    )
    _add_settings_option(serve)
    serve.add_argument("--max-batch", type=int, default=16, help="sequences decoded together (default: 16)")
    serve.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the batch (default: 64)")
    serve.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per prefill step")
    serve.add_argument("--default-max-tokens", type=int, default=None, help="max_tokens when a request omits it")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    serve.add_argument("--replicas", type=int, default=None,
                       help="N engine replicas behind one ingress on Ray Serve, a GPU or a share of the cores each "
                            "(needs fluxion-lite[cluster]; default: one engine, no Ray)")
    serve.set_defaults(handler=cmd_serve)

    calibrate = commands.add_parser(
        "calibrate", help="measure per-group sparse-attention error and write the model's fluxion plan"
    )
    calibrate.add_argument("model", help="catalog name or .gguf path")
    calibrate.add_argument("--samples", type=int, default=None,
                           help="calibration prompts (default: 3; 20 with --train)")
    calibrate.add_argument("--context", type=int, default=4096, help="tokens per prompt (default: 4096)")
    calibrate.add_argument("--positions", type=int, default=32, help="query positions measured per prompt (default: 32)")
    calibrate.add_argument("--sink", type=int, default=16)
    calibrate.add_argument("--window", type=int, default=64)
    calibrate.add_argument("--seed", type=int, default=0)
    calibrate.add_argument("--epsilon", type=float, default=None, help="error bound of the selector (default: policy's)")
    calibrate.add_argument("--from-labels", action="store_true", help="reuse the saved labels; only re-select the plan")
    calibrate.add_argument("--summary-weight", type=float, default=1.0,
                           help="cost of a byte of block summaries relative to a byte of K/V in the selector (default 1)")
    calibrate.add_argument("--out-dir", default=None,
                           help="where labels and plan go (default: the user cache, next to the models; the engine "
                                "looks there before the shipped plans)")
    calibrate.add_argument("--train", action="store_true",
                           help="instead of the static plan: collect predictor data on varied prompts (or reuse it "
                                "with --from-labels) and train the per-request head-property predictor")
    calibrate.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    calibrate.set_defaults(handler=cmd_calibrate)

    settings = commands.add_parser("settings", help="print every setting's effective value and where it came from")
    settings.add_argument("--markdown", action="store_true",
                          help="print the reference of every setting instead (docs/configuration.md)")
    _add_settings_option(settings)
    settings.set_defaults(handler=cmd_settings)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The environment's settings with the command line's over them (`--set` pairs, serve's --api-key)."""
    flags: dict[str, Any] = parse_assignments(getattr(args, "set_values", None) or [])
    if getattr(args, "api_key", None):
        flags["api_key"] = args.api_key
    return Settings.load(flags=flags)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the flags; unset flags keep the dataclass defaults. Validated here, before model load."""
    from fluxion_lite.engine.sampling import SamplingParams

    flag_to_field = {
        "max_tokens": "max_tokens",
        "temperature": "temperature",
        "top_k": "top_k",
        "top_p": "top_p",
        "min_p": "min_p",
        "repeat_penalty": "repetition_penalty",
        "presence_penalty": "presence_penalty",
        "frequency_penalty": "frequency_penalty",
        "seed": "seed",
        "epsilon": "epsilon",
    }
    values: dict[str, Any] = {
        field: getattr(args, flag) for flag, field in flag_to_field.items() if getattr(args, flag) is not None
    }
    params = SamplingParams(**values, stop=list(args.stop))
    params.validate()
    return params


def _check_device(device: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise FluxionError("--device cuda: no CUDA device is available here (use --device cpu)")


def _load_llm(args: argparse.Namespace) -> LLM:
    settings = settings_from_args(args)  # a bad setting stops the command before torch is imported
    from fluxion_lite.engine.llm import LLM

    if args.max_context is not None and args.max_context < 1:
        raise FluxionError(f"--max-context {args.max_context}: must be >= 1")
    _check_device(args.device)
    model = args.model or default_model_name()
    if args.threads is not None:
        if args.threads < 1:
            raise FluxionError(f"--threads {args.threads}: must be >= 1")
        import torch

        torch.set_num_threads(args.threads)
    llm = LLM(model, device=args.device, dtype=args.dtype, attention=args.attention, max_context=args.max_context,
              predictor=args.predictor, settings=settings)
    if args.explain:
        print(llm.engine.explain(), file=sys.stderr)
    return llm


def _write_stream(pieces: Iterable[str]) -> str:
    """Echo text pieces to stdout as they arrive; return the whole text."""
    out: list[str] = []
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
        out.append(piece)
    return "".join(out)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise RequestError("give the prompt either as an argument or with --prompt-file, not both")
    if args.prompt_file == "-":
        prompt = sys.stdin.read()
    elif args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompt = f.read()
        except UnicodeDecodeError as exc:
            raise RequestError(f"prompt file {args.prompt_file!r} is not UTF-8 text ({exc.reason})") from exc
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        raise RequestError("no prompt: give one as an argument or with --prompt-file")
    if not prompt:
        raise RequestError("empty prompt")
    return prompt


def cmd_pull(args: argparse.Namespace) -> int:
    from fluxion_lite.hub.pull import pull

    name = args.name or default_model_name()
    if name in catalog():
        path = pull(get_model(name), force=args.force)
    else:
        path = resolve_model(name, pull_missing=False)  # a local .gguf path is fine; anything else is unknown
        print(f"{path} is a local file; nothing to pull", file=sys.stderr)
    print(path)
    return 0


def _format_size(size: int | None) -> str:
    if size is None:
        return "?"
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


def cmd_models(args: argparse.Namespace) -> int:
    rows = list_models()
    header = ("NAME", "ARCH", "SIZE", "CONTEXT", "LOCAL", "PATH")
    table = [header] + [
        (
            row.name + (" *" if row.is_default else ""),
            row.arch,
            _format_size(row.size),
            str(row.context_length) if row.context_length is not None else "?",
            row.status,
            str(row.path),
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header) - 1)]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1])
    print("\n* default model.  pull with: fluxion-lite pull NAME")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
    params = sampling_params(args)
    llm = _load_llm(args)
    text = _write_stream(llm.generate_stream(prompt, params))
    if not text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    planner = getattr(llm.engine.attn, "planner", None)
    if args.explain and planner is not None:  # the request's own plan, made by the predictor after its prefill
        used = planner.last_plan is not None or planner.last_seq is not None
        print("after the request: " + ("the predictor planned it:\n" + planner.describe() if used else
                                       "prompt too short for the predictor; the static plan was used"), file=sys.stderr)
    return 0


def _chat_turn(llm: LLM, messages: list[dict[str, str]], params: SamplingParams) -> str | None:
    """Stream one assistant reply. None when the request was rejected; Ctrl-C ends the reply, not the chat."""
    stream = llm.chat(messages, params, stream=True)
    assert not isinstance(stream, str)
    pieces: list[str] = []
    try:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
            pieces.append(piece)
    except KeyboardInterrupt:
        print("\n[reply interrupted]", file=sys.stderr)
    finally:
        close: Callable[[], None] | None = getattr(stream, "close", None)
        if close is not None:
            close()  # let the engine release the request's KV now, not at garbage collection
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(pieces)


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = _load_llm(args)
    start: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    interactive = sys.stdin.isatty()
    if interactive:
        print("chat: /exit or Ctrl-D quits, /reset starts over", file=sys.stderr)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in EXIT_COMMANDS:
            return 0
        if text == "/reset":
            messages = list(start)
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = _chat_turn(llm, messages, params)
        except RequestError as exc:  # e.g. the conversation outgrew the context: drop the turn, keep chatting
            messages.pop()
            print(f"error: {exc}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply or ""})


def cmd_serve(args: argparse.Namespace) -> int:
    if not 1 <= args.port <= 65535:
        raise FluxionError(f"--port {args.port}: must be in 1..65535")
    args.settings = settings_from_args(args)  # what the server's engine gets (app.serve)
    try:
        app = importlib.import_module("fluxion_lite.server.app")
    except ModuleNotFoundError as exc:
        if exc.name in ("fluxion_lite.server.app", "fluxion_lite.server"):
            raise FluxionError("the HTTP server is not available in this install (fluxion_lite.server.app)") from exc
        if exc.name and exc.name.split(".")[0] in ("starlette", "uvicorn"):
            raise FluxionError(
                f"the server needs {exc.name.split('.')[0]}: pip install 'fluxion-lite[server]'"
            ) from exc
        raise
    if not hasattr(app, "serve"):
        raise FluxionError("fluxion_lite.server.app has no serve(args) function")
    _check_device(args.device)
    for flag in ("max_batch", "max_queue", "prefill_chunk", "default_max_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise FluxionError(f"--{flag.replace('_', '-')} {value}: must be >= 1")
    # The server loads the model in the background; resolve (and pull, with progress) now so a bad name fails here.
    args.model = args.model or default_model_name()
    resolve_model(args.model, settings=args.settings)
    if args.replicas is not None:
        if args.replicas < 1:
            raise FluxionError(f"--replicas {args.replicas}: must be >= 1")
        from fluxion_lite.cluster.launch import serve_cluster

        flags: dict[str, Any] = parse_assignments(getattr(args, "set_values", None) or [])
        if args.settings.api_key:
            flags["api_key"] = args.settings.api_key
        return serve_cluster(args, flags)
    result = app.serve(args)
    return int(result) if isinstance(result, int) else 0


def cmd_settings(args: argparse.Namespace) -> int:
    """`fluxion-lite settings`: each setting's effective value and its source (default, env FLUXION_X or flag),
    product settings first, then the experimental ones; --markdown: the reference (docs/configuration.md)."""
    if args.markdown:
        sys.stdout.write(reference_markdown())
        return 0
    settings = settings_from_args(args)
    # the model cache's effective directory rather than the rule (the rule is in the reference)
    rows = [(knob, str(cache_dir(settings)) if knob.name == "cache_dir" else value, source)
            for knob, value, source in settings.rows()]
    width = max(len(knob.env) for knob, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    for title, experimental in (("settings", False), ("experimental settings (A/B comparisons)", True)):
        if experimental:
            print()
        print(f"{title}:")
        for knob, value, source in rows:
            if knob.experimental == experimental:
                print(f"  {knob.env.ljust(width)}  {value.ljust(value_width)}  {source}")
    overridden = sum(source != "default" for _, _, source in rows)
    print(f"\n{overridden} of {len(rows)} set (env or {FLAG}); `fluxion-lite settings --markdown` describes each")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from fluxion_lite.offline.calibration import run_calibration
    from fluxion_lite.plan.selector import DEFAULT_EPSILON, load_labels, save_labels, select_plan

    if args.samples is None:
        args.samples = 20 if args.train else 3
    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    for name in ("samples", "context", "positions"):
        if getattr(args, name) < 1:
            raise FluxionError(f"--{name} {getattr(args, name)}: must be >= 1")
    if args.positions >= args.context:
        raise FluxionError(f"--positions {args.positions} must be smaller than --context {args.context}")
    out_dir = Path(args.out_dir) if args.out_dir else plan_files.user_dir()  # user data, never the installed package
    out_dir.mkdir(parents=True, exist_ok=True)
    name = Path(args.model).stem if args.model.endswith(".gguf") else args.model
    labels_path, plan_path = out_dir / f"{name}.calib.json", out_dir / f"{name}.plan.json"
    if args.train:
        return _train_predictor(args, out_dir, name)
    if args.from_labels:
        found = plan_files.find(name, ".calib.json")
        if not labels_path.is_file() and found is not None:  # re-select into another folder from saved labels
            labels_path = found
        if not labels_path.is_file():
            raise FluxionError(f"{labels_path}: no saved labels; run calibrate without --from-labels first")
        labels, meta = load_labels(labels_path)
    else:
        labels, meta = run_calibration(args.model, samples=args.samples, context=args.context, positions=args.positions,
                                       sink=args.sink, window=args.window, seed=args.seed)
        save_labels(labels_path, labels, meta)
        print(f"wrote {labels_path}")
    epsilon = DEFAULT_EPSILON if args.epsilon is None else args.epsilon
    if not args.summary_weight >= 0:
        raise FluxionError(f"--summary-weight must be >= 0, got {args.summary_weight}")
    weight_note = f", summary weight {args.summary_weight:g}" if args.summary_weight != 1.0 else ""
    plan = select_plan(labels, int(meta["n_layers"]), int(meta["n_groups"]), epsilon, int(meta["context"]),
                       int(meta["sink"]), int(meta["window"]), int(meta["head_dim"]),
                       source=f"calibrated on {meta['samples']} x {meta['context']} tokens, epsilon={epsilon:g}{weight_note}",
                       summary_weight=args.summary_weight)
    plan.save(plan_path)
    _stamp_plan(args.model, out_dir, name)
    print(plan.explain())
    print(f"wrote {plan_path}")
    return 0


def _stamp_plan(model: str, out_dir: Path, name: str) -> None:
    """Mark the plan as made for this model file, so that the engine calibrates again if the file changes
    (plan/auto_plan.py); left unstamped (used as it is) when the file is not at hand (--from-labels)."""
    from fluxion_lite.plan.auto_plan import write_stamp

    try:
        path = Path(model) if model.endswith(".gguf") else resolve_model(model, pull_missing=False)
    except FluxionError:
        return
    if path.is_file():
        write_stamp(out_dir, name, path)


def _train_predictor(args: argparse.Namespace, out_dir: Path, name: str) -> int:
    """calibrate --train: predictor data (collected, or the saved file with --from-labels), training, card."""
    from fluxion_lite.plan.selector import DEFAULT_EPSILON
    from fluxion_lite.offline.predictor_data import Dataset, collect
    from fluxion_lite.offline.predictor_train import train_and_report

    data_path = out_dir / f"{name}.predictor-data.npz"
    if args.from_labels:
        if not data_path.is_file():
            raise FluxionError(f"{data_path}: no saved predictor data; run calibrate --train without --from-labels")
        ds = Dataset.load(data_path)
    else:
        ds = collect(args.model, samples=args.samples, context=args.context, positions=args.positions, sink=args.sink,
                     window=args.window, seed=args.seed)
        ds.save(data_path)
        print(f"wrote {data_path}")
    if len(ds.kinds) < 2:
        raise FluxionError("--train needs at least 2 prompts (one is held out)")
    epsilon = DEFAULT_EPSILON if args.epsilon is None else args.epsilon
    pred, m = train_and_report(ds, out_dir, name, epsilon=epsilon, seed=args.seed)
    print(f"predictor: {pred.n_params} parameters; held-out accuracy {m['accuracy']:.3f} (static {m['accuracy_static']:.3f}),"
          f" deviation calibration error {m['ece_dev']:.3f} (log10), MAE {m['mae_log10']:.3f}")
    print(f"wrote {out_dir / f'{name}.predictor.npz'} and {out_dir / f'{name}.predictor.md'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        handler: Callable[[argparse.Namespace], int] = args.handler
        if hasattr(sys.stdout, "reconfigure"):
            sys.stdout.reconfigure(errors="replace")  # never die on a token the terminal cannot encode
        return handler(args)
    except FluxionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`| head`): silence the flush at exit, which would otherwise raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        if exc.filename is None:  # not a file problem: a bug or the system, keep the traceback
            raise
        print(f"error: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
