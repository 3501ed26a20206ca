"""Secrets in command lines and log lines do not reach postmortems or logs."""

from __future__ import annotations


def test_secrets_are_redacted():
    from sidecar.redact import REDACTED, redact_argv, redact_env

    argv = [
        "torchrun",
        "train.py",
        "--hf_token=hf_abc",
        "--password",
        "hunter2",
        "--lr",
        "1e-4",
        "WANDB_API_KEY=x",
        "--output-dir",
        "/ckpt",
    ]
    assert redact_argv(argv) == [
        "torchrun",
        "train.py",
        f"--hf_token={REDACTED}",
        "--password",
        REDACTED,
        "--lr",
        "1e-4",
        f"WANDB_API_KEY={REDACTED}",
        "--output-dir",
        "/ckpt",
    ]
    assert redact_env({"HF_TOKEN": "a", "AWS_SECRET_ACCESS_KEY": "b", "RANK": "0"}) == {
        "HF_TOKEN": REDACTED,
        "AWS_SECRET_ACCESS_KEY": REDACTED,
        "RANK": "0",
    }


def test_the_agent_log_line_is_redacted(proc_tree, caplog):
    import logging

    from sidecar.discovery import Discovery
    from sidecar.probes.proc import ProcReader
    from tests.conftest import AGENT

    cmdline = proc_tree / str(AGENT) / "cmdline"
    cmdline.write_bytes(cmdline.read_bytes() + b"--hf_token=hf_SECRETVALUE\0")
    with caplog.at_level(logging.INFO):
        Discovery(ProcReader(str(proc_tree))).tick()
    found = [r.getMessage() for r in caplog.records if "found torchrun agent" in r.getMessage()]
    assert found and "hf_SECRETVALUE" not in found[0] and "--hf_token=<redacted>" in found[0]
