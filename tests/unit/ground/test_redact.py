"""One redactor over everything that leaves the daemon: a table of real secret shapes (each
must lose its value) and harmless look-alikes (each must stay as written), then the same
redactor on argv, the environment, documents and the log."""

from __future__ import annotations

import logging

import pytest

from sidecar.redact import REDACTED, RedactingFilter, redact_argv, redact_doc, redact_env, redact_text

# Each value below has the shape of a real credential of its kind and is not one.
HF = "hf_" + "aBcDeFgHiJkLmNoPqRsTuVwXyZ012345"
GHP = "ghp_" + "0123456789abcdefghijABCDEFGHIJ012345"
GH_FINE = "github_pat_" + "11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOP0123"
GLPAT = "glpat-" + "xYz0123456789abcdefAB"
AKIA = "AKIA" + "IOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
SK = "sk-" + "abcdefghijklmnopqrstuvwxyz0123456789ABCD"
SK_PROJ = "sk-proj-" + "Ab12Cd34Ef56Gh78Ij90Kl12Mn34Op56"
WANDB = "0123456789abcdef0123456789abcdef01234567"
SLACK = "xoxb-" + "1234567890-0987654321-AbCdEfGhIjKlMnOp"
GOOGLE = "AIza" + "SyA0123456789abcdefghijklmnopqrstuv"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"

SECRETS = [
    # (text, the secret that must not survive)
    (f"export HF_TOKEN={HF}", HF),
    (f"huggingface-cli login --token {HF}", HF),
    (f"Downloading with token {HF} from the hub", HF),
    (f"GITHUB_PAT={GHP}", GHP),
    (f"git clone https://{GHP}@github.com/org/repo.git", GHP),
    (f"GH_TOKEN={GH_FINE}", GH_FINE),
    (f"remote: using {GH_FINE}", GH_FINE),
    (f"CI_JOB_TOKEN={GLPAT}", GLPAT),
    (f"https://oauth2:{GLPAT}@gitlab.example.com/x.git", GLPAT),
    (f"AWS_ACCESS_KEY_ID={AKIA}", AKIA),
    (f"aws configure set aws_access_key_id {AKIA}", AKIA),
    (f"AWS_SECRET_ACCESS_KEY={AWS_SECRET}", AWS_SECRET),
    (f"OPENAI_API_KEY={SK}", SK),
    (f"client = OpenAI(api_key='{SK_PROJ}')", SK_PROJ),
    (f"using key {SK}", SK),
    (f"WANDB_API_KEY={WANDB}", WANDB),
    (f"wandb login {WANDB}", WANDB),
    (f"python train.py --wandb-key {WANDB}", WANDB),
    (f"python train.py --wandb_key={WANDB}", WANDB),
    (f"python train.py --hf-key {HF}", HF),
    ("python train.py --hf_token=hunter2hunter2", "hunter2hunter2"),
    ("python train.py --password correct-horse", "correct-horse"),
    ("python train.py --passwd=letmein99", "letmein99"),
    ("mysql -u root -p Sup3rS3cret -h db", "Sup3rS3cret"),
    ("psql --pwd s3cr3tpw", "s3cr3tpw"),
    ("DB_PASSWORD=pa55w0rd", "pa55w0rd"),
    ("MLFLOW_TRACKING_PASSWORD: pa55w0rd2", "pa55w0rd2"),
    ('{"api_key": "k-12345678", "lr": 0.001}', "k-12345678"),
    ("secret_key = 'abcdef123456'", "abcdef123456"),
    ("COMET_API_KEY=cometkey123", "cometkey123"),
    ("NEPTUNE_API_TOKEN=neptok456", "neptok456"),
    ("AZURE_STORAGE_KEY=azkey789", "azkey789"),
    ("GOOGLE_APPLICATION_CREDENTIALS_JSON=credsblob", "credsblob"),
    ("DATABASE_URL=postgres://trainer:pgpass123@db:5432/runs", "pgpass123"),
    ("fetching https://user:tok3n@artifacts.example.com/w.bin", "tok3n"),
    ("redis://:redispass@cache:6379/0", "redispass"),
    ("Authorization: Bearer abc.def.ghi-0123456789", "abc.def.ghi-0123456789"),
    ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "dXNlcjpwYXNzd29yZA=="),
    (f"token={JWT}", JWT),
    (f"session cookie {JWT}", JWT),
    (f"slack: {SLACK}", SLACK),
    (f"maps key {GOOGLE}", GOOGLE),
    ("SSH_PRIVATE_KEY=-----BEGIN OPENSSH PRIVATE KEY-----", "OPENSSH PRIVATE KEY-----"),
    (
        "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7\n-----END RSA PRIVATE KEY-----",
        "MIIEowIBAAKCAQEA7",
    ),
    ("HUGGING_FACE_HUB_TOKEN=hfhubtok", "hfhubtok"),
    ("--auth admin:adminpw", "admin:adminpw"),
    ("X-Api-Key: 0f0f0f0f0f", "0f0f0f0f0f"),
    ("MY_PAT=patvalue1", "patvalue1"),
]

HARMLESS = [
    "python train.py --tokenizer meta-llama/Llama-3-8B --max-new-tokens 2048",
    "--author 'A. Researcher' --max_tokens 512 --num-tokens 4096",
    "tokens per second: 12345.6",
    "the token was refreshed",
    "Token indices sequence length is longer than the specified maximum",
    "Basic understanding of the data pipeline",
    "commit 0123456789abcdef0123456789abcdef01234567",  # a git sha: 40 hex, no wandb in sight
    "torchrun --nproc-per-node 4 -p 29500 train.py",  # -p as a port
    "PWD=/home/trainer/run",
    "OLDPWD=/home/trainer",
    "--sort-key length --keys a,b",
    "keyboard interrupt received",
    "passing 3 of 4 checks",
    "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "https://huggingface.co/meta-llama/Llama-3-8B/resolve/main/config.json",
    "sk-learn is not a package name, scikit-learn is",
    "OMP_NUM_THREADS=8 NCCL_DEBUG=INFO MASTER_ADDR=10.0.0.1",
]


@pytest.mark.parametrize(("text", "secret"), SECRETS, ids=[f"secret-{i}" for i in range(len(SECRETS))])
def test_every_secret_shape_loses_its_value(text, secret):
    out = redact_text(text)
    assert secret not in out, out
    assert REDACTED in out


@pytest.mark.parametrize("text", HARMLESS, ids=[f"harmless-{i}" for i in range(len(HARMLESS))])
def test_harmless_look_alikes_stay_readable(text):
    assert redact_text(text) == text


def test_the_table_is_big_enough():
    assert len(SECRETS) >= 40 and len(HARMLESS) >= 15


def test_argv_keeps_names_and_loses_values():
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
        "--wandb-key",
        WANDB,
        "-p",
        "29500",
        "--pwd",
        "pw1",
        "--data",
        "s3://bucket/data",
        "--push-url",
        "https://u:pw2@hub.example.com",
        "--max-new-tokens",
        "2048",
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
        "--wandb-key",
        REDACTED,
        "-p",
        "29500",
        "--pwd",
        REDACTED,
        "--data",
        "s3://bucket/data",
        "--push-url",
        f"https://u:{REDACTED}@hub.example.com",
        "--max-new-tokens",
        "2048",
    ]


def test_environment_and_documents():
    assert redact_env({"HF_TOKEN": "a", "AWS_SECRET_ACCESS_KEY": "b", "RANK": "0", "X": f"see {HF}"}) == {
        "HF_TOKEN": REDACTED,
        "AWS_SECRET_ACCESS_KEY": REDACTED,
        "RANK": "0",
        "X": f"see {REDACTED}",
    }
    doc = {"killer": {"evidence": [{"detail": f"export HF_TOKEN={HF}", "at": None}]}, "n": 3}
    assert redact_doc(doc) == {
        "killer": {"evidence": [{"detail": f"export HF_TOKEN={REDACTED}", "at": None}]},
        "n": 3,
    }


def test_the_log_filter_redacts_messages_and_arguments(caplog):
    log = logging.getLogger("trainwatch-test-redact")
    log.addFilter(RedactingFilter())
    with caplog.at_level(logging.INFO, logger=log.name):
        log.warning("rank 1 said: %s", f"export HF_TOKEN={HF}")
    assert HF not in caplog.text and REDACTED in caplog.text


def test_the_agent_log_line_is_redacted(proc_tree, caplog):
    from sidecar.probes.proc import ProcReader
    from sidecar.sampling.discovery import Discovery
    from tests.conftest import AGENT

    cmdline = proc_tree / str(AGENT) / "cmdline"
    cmdline.write_bytes(cmdline.read_bytes() + b"--hf_token=hf_SECRETVALUE\0")
    with caplog.at_level(logging.INFO):
        Discovery(ProcReader(str(proc_tree))).tick()
    found = [r.getMessage() for r in caplog.records if "found torchrun agent" in r.getMessage()]
    assert found and "hf_SECRETVALUE" not in found[0] and "--hf_token=<redacted>" in found[0]
