"""Generate the ``te-thd cache`` transcripts of ``docs/cli.md`` from real runs.

Builds a small cache with ``examples/precompute_cache.py`` (the demo's producer and
settings, fewer samples), runs ``te-thd cache info / verify / repair / unlock`` on it,
damages one shard, repairs it and lets the producer recompute it, and writes what
every command printed between the markers of ``docs/cli.md``. So the page cannot drift
from the code: ``tests/test_cli_transcripts.py`` fails when a block differs from what
this script produces today.

    python scripts/gen_cli_transcripts.py            # print the transcripts
    python scripts/gen_cli_transcripts.py --write    # rewrite the blocks in docs/cli.md
    python scripts/gen_cli_transcripts.py --check    # exit 1 (with a diff) if the page is stale

How it runs: a scratch directory plays the checkout's root (``examples/`` is linked
into it, the caches go to ``runs/``). Shell steps (the producer, ``cp``, the byte flip,
``cmp``) run as written with ``bash``, ``python`` being this interpreter. ``te-thd``
steps call the console script's function (``te_thd.cli.main``, what ``te-thd`` runs) in
this process: one interpreter start instead of one per command keeps the check at
seconds. Both use this checkout's ``te_thd`` (the script stops, saying so, when the
interpreter imports another one). What differs from run to run is
normalised: the scratch root and this checkout print as ``/path/to/te_thd``, the
temporary directory as ``/tmp``, this interpreter as ``python``, durations as ``<t> s``;
trailing blanks are dropped.

Adding a transcript: add a block to ``BLOCKS`` (its steps run after the previous
blocks', in the same scratch root), put its markers in docs/cli.md (copy a pair and
change the name) and run ``--write``.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from _docblock import read_block, write_block

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGE = REPO_ROOT / "docs" / "cli.md"
WRITE_COMMAND = ".venv/bin/python scripts/gen_cli_transcripts.py --write"
#: how the checkout's root (and the scratch root standing in for it) is shown
SHOWN_ROOT = "/path/to/te_thd"

#: the demo's producer and settings (``te-thd demo`` adds ``--num-samples 1024`` and the
#: default shard size 128), small enough to build in a second
BUILD = "python examples/precompute_cache.py --out {out} --cp 2 --num-samples 64 --shard-size 16"
#: one byte inside shard 2's tensor data, inverted: the sizes still match, a checksum does not
FLIP = (
    "python -c \"import sys; p = sys.argv[1]; b = bytearray(open(p, 'rb').read()); "
    "b[100000] ^= 0xFF; open(p, 'wb').write(b)\" runs/damaged/shard-000002.safetensors"
)


@dataclass(frozen=True)
class Step:
    """One command of a transcript: ``te-thd ARGS`` (``cli``) or a shell command line."""

    command: str
    cli: bool = False


def sh(command: str) -> Step:
    """A shell step, run as written (``python`` is this interpreter); it must exit 0."""
    return Step(command)


def te_thd(args: str) -> Step:
    """``te-thd args``; the transcript shows its output and exit status, whatever they are."""
    return Step(args, cli=True)


#: block name -> its steps, run in this order in one scratch root
BLOCKS: dict[str, list[Step]] = {
    "cli-transcript-sound": [
        sh(BUILD.format(out="runs/cache")),
        te_thd("cache info runs/cache"),
        te_thd("cache verify runs/cache"),
    ],
    "cli-transcript-damaged": [
        sh("cp -r runs/cache runs/damaged"),
        sh(FLIP),
        te_thd("cache verify --quick runs/damaged"),
        te_thd("cache verify runs/damaged"),
        te_thd("cache repair runs/damaged"),
        sh(BUILD.format(out="runs/damaged")),
        sh(
            "cmp runs/damaged/shard-000002.safetensors runs/cache/shard-000002.safetensors && echo identical"
        ),
        te_thd("cache repair runs/damaged"),
    ],
    "cli-transcript-manifest": [
        sh("cp -r runs/cache runs/lost && rm runs/lost/manifest.json"),
        te_thd("cache verify runs/lost"),
        te_thd("cache repair runs/lost"),
        te_thd("cache verify --quick runs/lost"),
    ],
    "cli-transcript-unlock": [
        te_thd("cache unlock runs/cache"),
    ],
    "cli-transcript-plan": [
        te_thd("cache plan --cp 2 --num-samples 1024 --compact-dtypes --hidden-codec fp8_e4m3"),
        sh("printf '# one length per line\\n3100\\n870\\n15000\\n4096\\n' > runs/lengths.txt"),
        te_thd(
            "cache plan --lengths runs/lengths.txt --max-len 16384 --key input_ids=int64:L --key seq_len=int64 "
            "--key hidden=bfloat16:L,4096 --length-key seq_len --shard-size 2 --cp 2"
        ),  # fmt: skip
        te_thd("cache plan --lengths runs/lengths.txt --key hidden=bfloat16:L,4096 --cp 3"),
    ],
}


def markers(name: str) -> tuple[str, str]:
    """The begin and end marker comments of block ``name`` in docs/cli.md."""
    return (
        f"<!-- {name}:begin (generated by scripts/gen_cli_transcripts.py; do not edit) -->",
        f"<!-- {name}:end -->",
    )


def _run_cli(args: list[str]) -> tuple[int, str]:
    """``te-thd args`` in this process; (exit status, stdout and stderr as a terminal shows them)."""
    from te_thd.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = main(args)
        except SystemExit as e:  # argparse errors
            status = e.code if isinstance(e.code, int) else 1
    return int(status or 0), out.getvalue()


def _run_shell(command: str, root: Path) -> str:
    """``command`` run with bash in ``root``; its output. A failing step stops the generator."""
    run = (
        f"{shlex.quote(sys.executable)} {command[len('python ') :]}"
        if command.startswith("python ")
        else command
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    done = subprocess.run(
        ["bash", "-c", run], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"step `{command}` exited {done.returncode}:\n{done.stdout}{done.stderr}"
        )
    return done.stdout + done.stderr


def normalise(text: str, root: Path) -> str:
    """Output as the page shows it: paths, interpreter and durations that vary replaced."""
    executables = {sys.executable, os.path.realpath(sys.executable)}
    for exe in sorted(executables, key=len, reverse=True):
        text = text.replace(shlex.quote(exe), "python").replace(exe, "python")
    for path in sorted({str(root), str(root.resolve()), str(REPO_ROOT)}, key=len, reverse=True):
        text = text.replace(path, SHOWN_ROOT)
    if tempfile.gettempdir() != "/tmp":  # e.g. the test suite's own TMPDIR
        text = text.replace(tempfile.gettempdir(), "/tmp")
    text = re.sub(r"\b\d+(?:\.\d+)? s\b", "<t> s", text)
    return "\n".join(line.rstrip() for line in text.splitlines())


def render() -> dict[str, str]:
    """Every block's text (without the markers): a ``console`` code block per transcript."""
    import te_thd

    if not Path(te_thd.__file__).resolve().is_relative_to(REPO_ROOT):
        raise SystemExit(
            f"te_thd is imported from {Path(te_thd.__file__).parent}, not from this checkout: "
            f"run  PYTHONPATH={REPO_ROOT} {sys.executable} {' '.join(sys.argv)}"
        )
    blocks: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="te_thd-cli-doc-") as d:
        root = Path(d)
        (root / "examples").symlink_to(REPO_ROOT / "examples", target_is_directory=True)
        (root / "runs").mkdir()
        with contextlib.chdir(root):
            for name, steps in BLOCKS.items():
                lines = []
                for step in steps:
                    if step.cli:
                        status, output = _run_cli(shlex.split(step.command))
                        shown = f'$ te-thd {step.command}; echo "exit $?"'
                        output += f"exit {status}\n"
                    else:
                        output = _run_shell(step.command, root)
                        shown = f"$ {step.command}"
                    lines += [shown, normalise(output, root)] if output.strip() else [shown]
                blocks[name] = "```console\n" + "\n".join(lines) + "\n```"
    return blocks


def stale_report(text: str, blocks: dict[str, str]) -> str | None:
    """None when every block of the page's ``text`` equals ``blocks``; else a diff of each stale
    block and the command that rewrites them."""
    out = []
    for name, body in blocks.items():
        current = read_block(text, *markers(name))
        if current is None:
            out.append(f"docs/cli.md lacks the markers of {name}: {' / '.join(markers(name))}")
        elif current != body:
            out += difflib.unified_diff(current.splitlines(), body.splitlines(), f"docs/cli.md {name}",
                                        "what the commands print today", lineterm="")  # fmt: skip
    if not out:
        return None
    return "\n".join([*out, f"docs/cli.md transcripts are stale: run  {WRITE_COMMAND}"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="rewrite the blocks in docs/cli.md")
    g.add_argument("--check", action="store_true", help="exit 1 when docs/cli.md is stale")
    args = ap.parse_args(argv)
    blocks = render()
    if not (args.write or args.check):
        print("\n\n".join(blocks.values()))
        return 0
    if args.check:
        report = stale_report(PAGE.read_text(), blocks)
        if report is not None:
            print(report, file=sys.stderr)
            return 1
        return 0
    missing = [name for name, body in blocks.items() if not write_block(PAGE, *markers(name), body)]
    if missing:
        print(
            f"{PAGE} lacks the markers of {missing}; copy a pair and change the name",
            file=sys.stderr,
        )
        return 1
    print(f"wrote {len(blocks)} transcripts to {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
