import hashlib
import json
import subprocess
import sys

from llmgw import keys


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmgw.cli", "keys", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=60,
    )


def test_hash_is_sha256_hex_of_the_key():
    assert keys.hash_key("sk-test") == "sha256:" + hashlib.sha256(b"sk-test").hexdigest()
    assert keys.is_key_hash(keys.hash_key("anything"))
    assert not keys.is_key_hash("sha256:" + "A" * 64)  # uppercase hex is not the format
    assert not keys.is_key_hash("sk-test")


def test_new_keys_are_distinct_and_long():
    a, b = keys.new_key(), keys.new_key()
    assert a != b and a.startswith("sk-llmgw-") and len(a) > 40


def test_cli_new_prints_a_key_and_its_hash():
    res = run_cli("new", "-o", "json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["hash"] == keys.hash_key(out["key"])
    text = run_cli("new")
    lines = dict(line.split(":", 1) for line in text.stdout.strip().splitlines())
    assert keys.hash_key(lines["key"].strip()) == lines["hash"].strip()


def test_cli_hash_prints_the_hash_alone():
    res = run_cli("hash", "sk-abc")
    assert res.returncode == 0 and res.stdout.strip() == keys.hash_key("sk-abc")
    res = run_cli("hash", "-", "-o", "json", stdin="sk-abc\n")
    assert json.loads(res.stdout) == {"hash": keys.hash_key("sk-abc")}


def test_cli_rejects_an_empty_key_and_bad_usage():
    res = run_cli("hash", "-", stdin="\n")
    assert res.returncode == 1 and "empty" in res.stderr
    assert run_cli("frobnicate").returncode == 2
    assert run_cli("new", "-o", "yaml").returncode == 2
