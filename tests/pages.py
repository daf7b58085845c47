"""The commands the pages show, as the tests read them: test_readmes.py runs each one
that no other test runs as written (the real launcher, fresh interpreters: conftest.run);
a test that runs a page's command takes it from the page with `readme_command(page,
*words)`, so what it launches is what the page says."""

from __future__ import annotations

import ast
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "DESIGN.md", *REPO.glob("0*/*.md"), *REPO.glob("docs/*.md"),
                REPO / "tests" / "README.md"])
NEEDS = re.compile(r"#\s*needs\b(.*)$")  # `cmd  # needs 8 GPUs`: parsed, not run
SHELL = ("pip ", "git ", "cd ", "sbatch ", "python -m pytest")  # setup, CI's own command, a cluster's


def fenced_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^ *```{lang}\n(.*?)^ *```", text, flags=re.S | re.M)


def page_commands(page: Path) -> list[tuple[str, str | None]]:
    """(command, what it needs, or None) for every command of the page's bash blocks; a
    line of `a && b` is two commands. Setup and CI's own test command are not ours to run."""
    out = []
    for block in fenced_blocks(page.read_text(), "bash"):
        for line in block.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            need = NEEDS.search(line)
            line = re.sub(r"\s+#.*$", "", line)
            for command in (c.strip() for c in line.split("&&")):
                if not command.startswith(SHELL):
                    out.append((command, need[1].strip() if need else None))
    return out


def split_command(command: str, save_dir: Path | None = None) -> dict:
    """A page's command taken apart: environment, launcher, its options, script, script
    args (outputs/ redirected to `save_dir`, when given)."""
    words = shlex.split(command)
    if words[0] == "sudo":
        words.pop(0)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    if save_dir is not None:
        words = [w.replace("outputs/", f"{save_dir}/") for w in words]
    assert words[0] in ("python", "torchrun"), f"{command}: starts with {words[0]!r}, not python or torchrun"
    i = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return {"env": env, "launcher": words[0], "options": words[1:i], "script": words[i], "args": words[i + 1:]}


def argv_of(parts: dict) -> list[str]:
    """The launch of a command taken apart, with this interpreter (torchrun as `python -m
    torch.distributed.run`, the same program)."""
    launch = [sys.executable] if parts["launcher"] == "python" else [sys.executable, "-m", "torch.distributed.run"]
    return [*launch, *parts["options"], parts["script"], *parts["args"]]


def find_command(page: str, *words: str) -> str:
    """The one command of `page` (a path from the repo root) that contains every word (or
    is the one word: a command that others extend)."""
    found = [c for c, need in page_commands(REPO / page) if need is None and all(w in c for w in words)]
    found = [c for c in found if c in words] or found
    assert len(found) == 1, f"{page}: {len(found)} runnable commands contain {words}: {found}"
    return found[0]


def readme_command(page: str, *words: str) -> list[str]:
    """The argv of the one runnable command of `page` that contains every word, for a test
    that runs it (adding its own size flags after it: argparse keeps the last). The page
    and the words are strings in the call, or names of module-level strings:
    test_readmes.py reads the calls to know which commands their own tests run."""
    parts = split_command(find_command(page, *words))
    assert not parts["env"], f"{page}: a command with variables is run by test_readmes.py"
    return argv_of(parts)


def commands_run_by_tests() -> dict[str, str]:
    """{command: the test file that runs it as written} for every readme_command call
    inside a call of conftest's `run` or `start` (a real launch) in the tests; a command
    a test runs warm (`run_warm`) is still run as written by test_readmes.py."""
    out = {}
    for path in sorted(REPO.glob("tests/*.py")):
        tree = ast.parse(path.read_text())
        strings = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                   and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                   for t in node.targets if isinstance(t, ast.Name)}
        launches = [n for n in ast.walk(tree)
                    if isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("run", "start")]
        for node in (n for launch in launches for n in ast.walk(launch)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "readme_command":
                args = [a.value if isinstance(a, ast.Constant) else strings.get(getattr(a, "id", None))
                        for a in node.args]
                assert len(args) >= 2 and all(isinstance(a, str) for a in args), \
                    f"{path.name}:{node.lineno}: readme_command takes strings (a page, then words)"
                out[find_command(*args)] = path.name
    return out
