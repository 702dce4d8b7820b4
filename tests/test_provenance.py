"""Every benchmark result is traceable (issue 25 item 6), and the report claims only what it
checked (item 5)."""

import subprocess
import tarfile
from pathlib import Path

from specrouter.bench.provenance import archived_commit, cpu_description, describe, git_revision, provenance
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


def test_a_git_archive_copy_names_the_commit_it_was_made_from(tmp_path):
    """The package's commit.txt is marked export-subst: `git archive` writes the commit into it,
    so a bench run from an archive copy (no .git) still records its commit. Uses this
    repository's own .gitattributes line and placeholder, in a scratch repository."""
    repo_root = Path(__file__).resolve().parents[1]
    stamp = Path("src/specrouter/bench/commit.txt")
    attributes = (repo_root / ".gitattributes").read_text()
    assert f"{stamp} export-subst" in attributes
    src = tmp_path / "repo"
    (src / stamp.parent).mkdir(parents=True)
    (src / stamp).write_text((repo_root / stamp).read_text())
    (src / ".gitattributes").write_text(attributes)
    git = ["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    sha = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    tar = tmp_path / "copy.tar"
    subprocess.run(git + ["archive", "-o", str(tar), "HEAD"], check=True)
    with tarfile.open(tar) as archive:
        archive.extractall(tmp_path / "copy", filter="data")
    assert archived_commit(tmp_path / "copy" / stamp) == sha
    # control: in a checkout the placeholder is not a commit
    assert archived_commit(repo_root / stamp) is None
    assert archived_commit(tmp_path / "missing.txt") is None
