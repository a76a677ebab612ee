import subprocess

from bench.common import git_commit, git_tree


def _git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def test_git_commit_marks_a_tree_that_differs_from_its_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no checkout above tmp_path answers
    assert git_commit(str(tmp_path)) is None and git_tree(str(tmp_path)) is None  # not a checkout
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                         text=True).stdout.strip()
    assert git_commit(str(tmp_path)) == sha
    tree = subprocess.run(["git", "log", "-1", "--format=%t"], cwd=tmp_path, capture_output=True, text=True).stdout
    assert git_tree(str(tmp_path)) == tree.strip()[:7]
    (tmp_path / "untracked.txt").write_text("ignored by the mark\n")
    assert git_commit(str(tmp_path)) == sha
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(str(tmp_path)) == sha + "+dirty"
    assert git_tree(str(tmp_path)) not in (None, tree.strip()[:7])  # the tree as its files are now


def test_hbm_rooflines_use_the_devices_measured_copy_bandwidth():
    from bench.common import hbm_bytes_per_s

    assert hbm_bytes_per_s("NVIDIA H200") == 4.3e12
    assert hbm_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.02e12  # bench/results/env_check_h100.json
    assert hbm_bytes_per_s("cpu") == 4.3e12  # not in the table: the H200's, stated in every record
