"""Every benchmark result is traceable (issue 25 item 6), and the report claims only what it
checked (item 5)."""

import subprocess

from specrouter.bench.provenance import cpu_description, describe, git_revision, provenance
from specrouter.bench.report import identity_goal


def test_provenance_names_commit_cpu_simd_threads_torch_and_load():
    p = provenance()
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert p["commit"] == head and isinstance(p["dirty"], bool)
    flags = open("/proc/cpuinfo").read()
    assert ("avx2" in p["simd"]) == (" avx2" in flags)
    assert ("avx512_bf16" in p["simd"]) == (" avx512_bf16" in flags)
    assert p["cpu"] and p["cores"] >= 1 and p["threads"] >= 1 and p["torch"] and p["kernels"]
    line = describe(p)
    assert head[:10] in line and p["cpu"] in line


def test_outside_a_checkout_the_commit_is_unknown_not_invented(tmp_path):
    assert git_revision(tmp_path) == {"commit": None, "dirty": None}


def test_a_dirty_tree_is_recorded(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f").write_text("a")
    subprocess.run(["git", "-C", str(tmp_path), "add", "f"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
                   check=True)
    assert git_revision(tmp_path)["dirty"] is False
    (tmp_path / "f").write_text("b")
    assert git_revision(tmp_path)["dirty"] is True


def test_cpu_description_reads_the_model_name():
    assert cpu_description()["cpu"]


def test_greedy_identity_is_met_only_when_a_greedy_request_was_compared():
    sampled_only = [{"greedy": False, "requests": [1, 2]}]
    assert identity_goal(sampled_only)["met"] is None
    assert "not checked" in identity_goal(sampled_only)["scope"]
    with_greedy = sampled_only + [{"greedy": True, "requests": [1]}]
    assert identity_goal(with_greedy)["met"] is True
