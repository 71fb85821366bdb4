"""`make demo`: a real vLLM server survives a P0/P1 multimodal cache miss.

Serves the tiny LLaVA with the plugin and the test-only fault switch
(VLLM_MMRETRY_FAULTS=p1_miss=every:1: the first cache-hit lookup in the engine
core, i.e. the second request for an image, finds its P1 entry gone), sends two
identical image chat requests, prints both answers and the server log lines that
show the miss and the retry, then the output-loop speed-up from the benchmark."""

from __future__ import annotations

import base64
import io
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import servers  # noqa: E402
import tiny_model  # noqa: E402

FAULTS = "p1_miss=every:1"
LOG_MARKERS = (
    "TEST FAULT SWITCH ON",  # the switch announces itself (API server line only)
    "vllm-mmretry fault: dropped",  # the switch drops P1's entry
    "Multi-modal cache miss for request",  # vLLM's engine core reports the miss
    "vllm-mmretry: retrying",  # our serving layer retries with the data
)
BENCH = ROOT / "benches" / "bench_output_loop.py"


def image_url() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 120, 40)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def log_lines(log: str) -> list[str]:
    """The log lines holding a marker; the switch's banner only once (every
    process prints it)."""
    out, banner = [], False
    for line in log.splitlines():
        if LOG_MARKERS[0] in line:
            if banner:
                continue
            banner = True
        if any(marker in line for marker in LOG_MARKERS):
            out.append(line.strip())
    return out


def chat_demo() -> bool:
    import openai

    model = str(tiny_model.ensure_tiny_model())
    print(f"starting vllm serve {model} with VLLM_MMRETRY_FAULTS={FAULTS} (about 30 s)",
          flush=True)
    with servers.serve(model, env={"VLLM_MMRETRY_FAULTS": FAULTS}) as server:
        client = openai.OpenAI(base_url=server.openai_url, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url()}},
            {"type": "text", "text": "What is in this picture?"}]}]
        answers = []
        for i in (1, 2):
            t0 = time.perf_counter()
            try:
                r = client.chat.completions.create(model=model, messages=messages,
                                                   temperature=0, max_tokens=12)
            except openai.APIStatusError as e:
                print(f"request {i}: HTTP {e.status_code}: {e.message}")
                answers.append(None)
                continue
            ms = (time.perf_counter() - t0) * 1e3
            answers.append(r.choices[0].message.content)
            print(f"request {i}: HTTP 200 in {ms:.0f} ms: {answers[-1]!r}")
        time.sleep(0.5)  # let the engine core's log lines land
        ok = answers[0] is not None and answers[0] == answers[1]
        print("identical answers:", ok)
        print(f"\nserver log ({server.log_path}):")
        for line in log_lines(server.log()):
            print("  " + line)
    return ok


def bench_summary() -> None:
    """Stock vs ours per request-step at batch 64 and 1024 (about 15 s; `make bench`
    runs every batch size)."""
    args = ["--variants", "plain,stop2,n4", "--batches", "64,1024"]
    print(f"\noutput loop, stock vLLM vs vllm-mmretry (benches/bench_output_loop.py {' '.join(args)}):",
          flush=True)
    out = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True,
                         text=True, timeout=900, env=servers.server_env())
    rows = []
    for line in out.stdout.splitlines():
        if line.startswith("{") and '"ratio"' in line:
            rows.append(json.loads(line))
    if out.returncode != 0 or not rows:
        print(f"  benchmark did not run (exit {out.returncode}): {out.stderr.strip()[-600:]}")
        return
    for row in rows:
        print(f"  {row['variant']:6s} batch {row['batch']:5d}: stock {row['stock_us']:6.2f} µs, "
              f"ours {row['ours_us']:6.2f} µs per request-step -> {row['ratio']:.2f}x")


def main() -> int:
    ok = chat_demo()
    bench_summary()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
