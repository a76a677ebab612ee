import shutil
import subprocess

import pytest

from launcher.slurm import TEMPLATES, main, render


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_templates_render_and_parse(template, tmp_path):
    text = render(template, nodes=1 if template == "single" else 4, gpus_per_node=8, partition="gpu",
                  account="proj", time="02:00:00")
    assert "#SBATCH --partition=gpu" in text and "#SBATCH --account=proj" in text
    assert "launcher/main.py" in text
    p = tmp_path / "job.sbatch"
    p.write_text(text)
    subprocess.run(["bash", "-n", str(p)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    res = subprocess.run(["shellcheck", "-S", "warning", str(p)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


def test_multi_node_uses_c10d_rendezvous_on_first_node():
    text = render("multi")
    assert "--rdzv_backend c10d" in text and "head_node" in text and "NCCL_NVLS_ENABLE=0" in text


def test_usage_error_without_config(tmp_path):
    p = tmp_path / "job.sbatch"
    p.write_text(render("multi"))
    res = subprocess.run(["bash", str(p)], capture_output=True, text=True)
    assert res.returncode == 2 and "usage" in res.stderr


def test_cli_rejects_single_with_nodes(capsys):
    assert main(["--template", "single", "--nodes", "2"]) == 2
