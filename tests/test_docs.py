"""Cheap consistency checks of the README and the documentation site.

The strict MkDocs build itself runs in `scripts/test.sh` (it needs the docs extra); these
checks need nothing but the files: the README's two commands are the ones CI runs, every page
is in the site's navigation, every relative link resolves, the API pages cover the modules the
site promises, the CLI table lists the CLI's commands, and the getting-started script runs.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokencapture import TokenCaptureStore, TokenEntry, cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
INSTALL_COMMAND = "pip install . && python -m tokencapture demo"
TEST_COMMAND = "bash scripts/test.sh"
# The modules whose docstrings the site's API reference is generated from.
API_MODULES = (
    "records",
    "protocols",
    "store",
    "lineage",
    "ledger",
    "staging_records",
    "fingerprint",
    "conformance",
    "config",
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def code_blocks(text: str, language: str) -> list[str]:
    return [body.strip() for body in re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)]


def nav_pages() -> list[str]:
    """The .md paths named in mkdocs.yml's nav (read as text: no YAML parser needed)."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:") :]
    return re.findall(r"^\s+-\s+(?:[^\n]*?:\s+)?([\w./-]+\.md)\s*$", nav, re.M)


def markdown_files() -> list[Path]:
    return [README, ROOT / "benches" / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_readme_commands_come_first_and_are_what_ci_runs() -> None:
    readme = README.read_text()
    assert code_blocks(readme, "bash")[:2] == [INSTALL_COMMAND, TEST_COMMAND]
    # Nothing but the title and the introduction stands before the install section.
    first_heading = re.search(r"^## (.+)$", readme, re.M)
    assert first_heading is not None and first_heading.group(1) == "Install"
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in ci.splitlines() if line.strip() and line[0] != "#"]
    assert f"exec {TEST_COMMAND}" in commands
    # The getting-started page repeats them verbatim.
    started = (DOCS / "getting-started.md").read_text()
    assert code_blocks(started, "bash")[:2] == [INSTALL_COMMAND, TEST_COMMAND]


def test_demo_is_a_cli_command() -> None:
    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "demo" in sub.choices


def test_readme_cli_table_lists_every_command() -> None:
    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for page in (README, DOCS / "cli.md"):
        lines = page.read_text().splitlines()
        start = lines.index("| command | what it does |")
        rows = []
        for line in lines[start + 2 :]:
            if not line.startswith("|"):
                break
            rows.append(line.split("|")[1])
        listed = set(re.findall(r"`(\w+)[ `]", "\n".join(rows)))
        assert listed == set(sub.choices), page


def test_ci_builds_the_docs_strictly_with_the_docs_extra() -> None:
    script = (ROOT / "scripts" / "test.sh").read_text()
    build = re.search(r"^.*mkdocs build.*$", script, re.M)
    assert build is not None
    assert "--strict" in build.group(0)
    # --quiet hides warnings, and strict mode then passes over them.
    assert "--quiet" not in build.group(0) and " -q" not in build.group(0)
    assert '["optional-dependencies"]["docs"]' in script
    pyproject = (ROOT / "pyproject.toml").read_text()
    docs_extra = re.search(r"^docs = \[(.*)\]$", pyproject, re.M)
    assert docs_extra is not None
    for package in ("mkdocs", "mkdocs-material", "mkdocstrings[python]"):
        assert f'"{package}>=' in docs_extra.group(1)
    assert re.search(r"^/?site/?$", (ROOT / ".gitignore").read_text(), re.M)


def test_every_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    nav = nav_pages()
    assert len(nav) == len(set(nav)), "a page is in the nav twice"
    on_disk = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    assert set(nav) == on_disk


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    text = FENCE.sub("", page.read_text())
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        resolved = (page.parent / path).resolve()
        if not resolved.exists():
            broken.append(target)
        elif page.is_relative_to(DOCS) and not resolved.is_relative_to(DOCS):
            broken.append(f"{target} (outside docs/: the site cannot link it)")
    assert broken == []


def resolve(dotted: str) -> object:
    """The module or the attribute of a module that `dotted` names."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for name in parts[split:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_repository_paths_named_in_code_exist(page: Path) -> None:
    """`scripts/...`, `bash scripts/test.sh`, `tests/...` and the like are files of this tree."""
    prefix = re.compile(r"(?:scripts|benches|tests|rust|fuzz|python|docs|\.ci)/[\w./-]*")
    named = [
        word
        for span in re.findall(r"`([^`\n]+)`", FENCE.sub("", page.read_text()))
        for word in span.split()
        if prefix.fullmatch(word)
    ]
    missing = [path for path in named if ".scratch" not in path and not (ROOT / path).exists()]
    assert missing == []


def test_api_pages_cover_the_promised_modules() -> None:
    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        for name in re.findall(r"^::: (tokencapture[\w.]*)$", page.read_text(), re.M):
            resolve(name)
            documented.add(name)
    assert documented >= {f"tokencapture.{name}" for name in API_MODULES}
    assert "paths: [python]" in (ROOT / "mkdocs.yml").read_text()


def test_benchmarks_page_includes_the_methods_of_benches_readme() -> None:
    page = (DOCS / "benchmarks.md").read_text()
    assert '--8<-- "benches/README.md:methods"' in page
    methods = (ROOT / "benches" / "README.md").read_text()
    assert "[start:methods]" in methods and "[end:methods]" in methods
    assert methods.index("[start:methods]") < methods.index("## Micro benchmarks")
    assert methods.index("## Profiling a cell") < methods.index("[end:methods]")


def run_example(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """A page's Python example run as a script with warnings as errors (it must exit 0)."""
    (tmp_path / "example.py").write_text(script + "\n")
    done = subprocess.run(
        [sys.executable, "-W", "error", str(tmp_path / "example.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_getting_started_script_runs(tmp_path: Path) -> None:
    page = (DOCS / "getting-started.md").read_text()
    (script,) = [block for block in code_blocks(page, "python") if "asyncio.run(" in block]
    done = run_example(script, tmp_path)
    assert done.stderr == ""
    # Three calls put, then a freeze: three entries, every begun call has its entry.
    assert done.stdout.startswith("3 entries, version ")
    assert done.stdout.rstrip().endswith(" complete")


def test_on_disk_example_is_what_the_store_writes(tmp_path: Path) -> None:
    page = (DOCS / "on-disk-format.md").read_text()
    line, state = code_blocks(page, "json")[:2]
    store = TokenCaptureStore(tmp_path)
    store._begin_call("rollout-7", "call-1")
    store.append(
        TokenEntry(
            rollout_id="rollout-7",
            model_call_id="call-1",
            prompt_token_ids=[1, 2, 3],
            generation_token_ids=[4, 5],
            generation_log_probs=[-0.25, -1.5],
        )
    )
    store.freeze_now("rollout-7")
    names = {path.name for path in tmp_path.iterdir()}
    assert names == {
        f"rollout-7.tokens.{suffix}" for suffix in ("jsonl", "state.json", "intents", "lock")
    }
    assert (tmp_path / "rollout-7.tokens.jsonl").read_text() == line + "\n"
    assert (tmp_path / "rollout-7.tokens.intents").read_text() == "call-1\n"
    assert (tmp_path / "rollout-7.tokens.lock").read_bytes() == b""
    written = json.loads((tmp_path / "rollout-7.tokens.state.json").read_text())
    documented = json.loads(state)
    assert len(written.pop("snapshot_id")) == len(documented.pop("snapshot_id")) == 32
    assert written == documented
    # What the page says about the state, computed independently of the store.
    assert documented["indexed_size"] == len(line.encode()) + 1
    assert documented["entry_digests"]["call-1"] == hashlib.sha256(line.encode()).hexdigest()


def name_table(page: Path, header: str) -> list[tuple[str, str]]:
    """The rows (reference names, where they live) of the table under `header`."""
    lines = page.read_text().splitlines()
    start = lines.index(header)
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        reference, here = line.split("|")[1:3]
        rows.append((reference.strip(), here.strip()))
    return rows


NAME_TABLE = "| reference name (`nemo_gym.token_id_capture.…`) | here |"


def test_readme_and_index_list_the_same_names() -> None:
    def unlinked(cell: str) -> str:
        return re.sub(r"\[(`[^`]+`)\]\([^)]+\)", r"\1", cell)

    readme = name_table(README, NAME_TABLE)
    index = name_table(DOCS / "index.md", NAME_TABLE)
    assert readme == [(reference, unlinked(here)) for reference, here in index]


@pytest.mark.parametrize("page", [README, DOCS / "index.md"], ids=lambda p: p.name)
def test_every_name_of_the_name_table_is_importable_from_tokencapture(page: Path) -> None:
    """The pages say `tokencapture` re-exports the public names of each module in the table:
    every name in either column, and the constants, errors and `install_*` functions the
    first column names in words, are attributes of the top-level package."""
    import tokencapture

    expected: set[str] = set()
    for reference, here in name_table(page, NAME_TABLE):
        spans = re.findall(r"`([^`]+)`", here)
        module = resolve(spans[0])
        if not isinstance(module, type(tokencapture)):
            module = importlib.import_module(spans[0].rsplit(".", 1)[0])
        public = list(getattr(module, "__all__", []))
        for span in re.findall(r"`([^`]+)`", reference) + spans[1:]:
            name = span.rsplit(".", 1)[-1]
            if span == f"tokencapture.{span.split('.')[-1]}" or span == "conformance":
                continue  # a module named whole (its names are its own page's)
            if name.endswith("(s)"):
                expected |= {name[:-3], name[:-3] + "s"}
            elif "*" in name:
                matched = [n for n in public if re.fullmatch(name.replace("*", r"\w+"), n)]
                assert matched, (span, module.__name__)
                expected |= set(matched)
            else:
                expected.add(name)
        if "the constants" in reference:
            expected |= {n for n in public if n.isupper() and not n.startswith("_")}
        if "the errors" in reference:
            expected |= {n for n in public if n.endswith("Error")}
    assert len(expected) > 40
    missing = sorted(name for name in expected if not hasattr(tokencapture, name))
    assert missing == []
    assert sorted(name for name in expected if name not in tokencapture.__all__) == []


def test_staging_example_builds_and_stages_a_chain(tmp_path: Path) -> None:
    """The staging page's example of building records to stage runs as shown."""
    page = (DOCS / "staging.md").read_text()
    (script,) = [block for block in code_blocks(page, "python") if "build_chain(" in block]
    assert '"/tmp/staging-example"' in script
    script = script.replace('"/tmp/staging-example"', repr(str(tmp_path / "staging")))
    done = run_example(script, tmp_path)
    assert done.stdout == "['rollout-7/call-0', 'rollout-7/call-1', 'rollout-7/call-2'] 24\n"
