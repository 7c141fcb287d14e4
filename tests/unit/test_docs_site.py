"""The documentation site (mkdocs.yml, docs/) and the README, its entrance, hold together.

Pure: reads files, and runs the documented commands that need no TensorFlow. `tox -e docs` builds the site with
`mkdocs build --strict`, which checks links and anchors too; these tests check the same without MkDocs, so the
default test run catches a broken link, a page missing from the navigation or a snippet that no longer compiles.

Snippets: every ```python snippet of the README, the pages and benchmarks/README.md is compiled here. Those that need
no TensorFlow are run here: the `hetero-cs plan` what-if commands (no python snippet uses only the pure layer).
`test_self_contained_snippets_run` (slow) runs each python snippet that stands on its own, on emulated devices. The
others are compiled only, for the reason `_why_not_run` gives: a `[...]` placeholder, names the snippet does not
define (`model`, `dataset`, `build_model`, ...: the page's prose or an earlier snippet does), or a strategy built
without `emulate=`, which needs real GPUs.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import unicodedata

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MAX_README_LINES = 250

_SNIPPET_INCLUDE = re.compile(r'^[ \t]*-{1,}8<-{1,}[ \t]+"([^"]+)"[ \t]*$', re.M)
_SECTION_MARKER = re.compile(r"^.*-{1,}8<-{1,}[ \t]+\[[ \t]*(start|end)[ \t]*:[ \t]*([a-z][-_0-9a-z]*)[ \t]*\].*$")
_FENCE = re.compile(r"^( *)(```|~~~)(\w*)[^\n]*\n(.*?)^\1\2[ \t]*$", re.M | re.S)


def _section(text: str, name: str | None) -> str:
    """A file's text as the snippets extension includes it: the named section only, without marker lines."""
    lines, keep = [], name is None
    for line in text.split("\n"):
        marker = _SECTION_MARKER.match(line)
        if marker:
            if marker.group(2) == name:
                keep = marker.group(1) == "start"
            continue
        if keep:
            lines.append(line)
    return "\n".join(lines)


def expanded(path: pathlib.Path) -> str:
    """A page as MkDocs renders it: `--8<-- "file"` and `--8<-- "file:section"` lines replaced by what they
    include (paths from the repository root, as mkdocs.yml's `base_path`)."""

    def include(match: re.Match) -> str:
        target, _, name = match.group(1).partition(":")
        included = ROOT / target
        assert included.is_file(), f"{path.relative_to(ROOT)} includes {target}, which does not exist"
        text = _section(included.read_text(encoding="utf-8"), name or None)
        assert text.strip(), f"{path.relative_to(ROOT)} includes an empty or missing section {match.group(1)!r}"
        return text

    return _SNIPPET_INCLUDE.sub(include, path.read_text(encoding="utf-8"))


def _prose(text: str) -> str:
    """Text without fenced code blocks, inline code or HTML comments (where nothing is a link or a heading)."""
    text = _FENCE.sub("", text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", text, flags=re.S)


def slug(heading: str) -> str:
    """Python-Markdown's `toc` slug of a heading (what MkDocs and Material make its anchor)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link's text
    text = text.replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(text: str) -> set[str]:
    """The ids of a page's headings, duplicates numbered `_1`, `_2`, ... as `toc` numbers them."""
    seen: set[str] = set()
    for match in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", _FENCE.sub("", text), flags=re.M):
        base = candidate = slug(match.group(1))
        number = 0
        while candidate in seen:
            number += 1
            candidate = f"{base}_{number}"
        seen.add(candidate)
    return seen


def links(text: str) -> list[str]:
    """Every link target of a page: inline links, images and reference definitions."""
    prose = _prose(text)
    inline = re.findall(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
    return inline + list(_reference_definitions(prose).values())


def _reference_definitions(prose: str) -> dict[str, str]:
    return {label.lower(): target for label, target in re.findall(r"^ {0,3}\[([^\]]+)\]:\s*<?(\S+?)>?\s*$", prose,
                                                                  flags=re.M)}


def _pages() -> list[pathlib.Path]:
    return sorted(DOCS.rglob("*.md"))


def _documents() -> list[tuple[pathlib.Path, str]]:
    """README and every page, as rendered (includes expanded)."""
    return [(README, README.read_text(encoding="utf-8"))] + [(page, expanded(page)) for page in _pages()]


def _nav() -> list[str]:
    """The pages mkdocs.yml's `nav` lists (paths relative to docs/)."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    block = re.search(r"^nav:\n((?:[ \t]+.*\n|\n)+)", config, flags=re.M)
    assert block, "mkdocs.yml has no nav"
    return re.findall(r"^[ \t]*-[^\n]*?([\w/.-]+\.md)[ \t]*$", block.group(1), flags=re.M)


# ---- the README is the entrance ----------------------------------------------------------------------------------


def test_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; the entrance keeps to {MAX_README_LINES}"


@pytest.mark.parametrize("part", [
    "python examples/train_digits.py",   # the main job
    "pip install tox && tox",            # the tests, what CI runs
    "Install size",
    "### When not to use it",
    "## Quick start",
    "tox -e docs",
])
def test_the_readme_holds_the_entrance(part):
    assert part in README.read_text(encoding="utf-8")


def test_the_readme_links_every_page():
    targets = {target.split("#")[0] for target in links(README.read_text(encoding="utf-8"))}
    for page in _nav():
        if page in ("index.md", "benchmarks.md"):
            continue
        assert f"docs/{page}" in targets, f"README.md does not link docs/{page}"
    assert "benchmarks/README.md" in targets


def test_the_docs_home_page_is_the_readme_entrance():
    """docs/index.md includes README's entrance (one source), and the two agree on what its links mean."""
    home = expanded(DOCS / "index.md")
    entrance = _section(README.read_text(encoding="utf-8"), "entrance")
    assert entrance.strip() and entrance in home
    readme_refs = _reference_definitions(_prose(README.read_text(encoding="utf-8")))
    home_refs = _reference_definitions(_prose(home))
    for label in set(re.findall(r"\]\[([^\]]+)\]", _prose(entrance))):
        label = label.lower()
        assert label in readme_refs and label in home_refs, f"[{label}] is not defined in README.md and index.md"
        assert readme_refs[label] == "docs/" + home_refs[label], (label, readme_refs[label], home_refs[label])


def test_ci_builds_the_docs_strictly():
    import configparser

    tox = configparser.ConfigParser()
    tox.read(ROOT / "tox.ini")
    assert "mkdocs build --strict" in tox["testenv:docs"]["commands"]
    assert "tox -e docs" in (ROOT / ".ci" / "run").read_text()


# ---- the site's pages and links ----------------------------------------------------------------------------------


def test_the_navigation_lists_every_page_once():
    nav = _nav()
    assert len(nav) == len(set(nav)), "a page is listed twice in mkdocs.yml's nav"
    on_disk = {page.relative_to(DOCS).as_posix() for page in _pages()}
    assert set(nav) - on_disk == set(), "mkdocs.yml's nav lists pages that do not exist"
    assert on_disk - set(nav) == set(), "pages under docs/ that mkdocs.yml's nav does not list"


def test_relative_links_and_anchors_resolve():
    rendered = {path.resolve(): text for path, text in _documents()}
    rendered[(ROOT / "benchmarks" / "README.md").resolve()] = (ROOT / "benchmarks" / "README.md").read_text()
    broken = []
    for path, text in _documents():
        for target in links(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            destination = (path.parent / file_part).resolve() if file_part else path.resolve()
            where = f"{path.relative_to(ROOT)} -> {target}"
            if not destination.exists():
                broken.append(f"{where}: no such file")
            elif anchor and destination.suffix == ".md" and anchor not in anchors(rendered.get(
                    destination, destination.read_text(encoding="utf-8"))):
                broken.append(f"{where}: no heading with that anchor")
    assert not broken, "\n".join(broken)


def test_reference_links_are_defined():
    for path, text in _documents():
        prose = _prose(text)
        defined = _reference_definitions(prose)
        for text_, label in re.findall(r"\[([^\]\n]+)\]\[([^\]\n]*)\]", prose):
            assert (label or text_).lower() in defined, f"{path.relative_to(ROOT)}: [{label or text_}] is not defined"


def test_the_slug_is_python_markdowns():
    assert slug("What hetero_cs fixes in stock CentralStorageStrategy") == (
        "what-hetero_cs-fixes-in-stock-centralstoragestrategy")
    assert slug("`--policy mixed_float16` (and `mixed_bfloat16`)") == "-policy-mixed_float16-and-mixed_bfloat16"
    assert slug("failover.py") == "failoverpy"
    assert anchors("# A\n## Limits\n```\n# not a heading\n```\n## Limits\n") == {"a", "limits", "limits_1"}


# ---- the API reference ------------------------------------------------------------------------------------------


def _public_names() -> list[str]:
    tree = ast.parse((ROOT / "hetero_cs" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("hetero_cs/__init__.py has no __all__")


def _module_source(dotted: str) -> str | None:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8")
    return None


def _defines(source: str | None, name: str) -> bool:
    return source is not None and re.search(rf"^(class|def) {re.escape(name)}\b", source, flags=re.M) is not None


def test_the_api_reference_covers_the_public_api():
    """Every name of `hetero_cs.__all__` has a `::: ...` entry on an API page, at the module that defines it
    (mkdocstrings reads the source without importing it, so it cannot follow the lazy TensorFlow-facing names)."""
    directives = [line.split(":::", 1)[1].split()[0] for page in sorted((DOCS / "api").glob("*.md"))
                  for line in page.read_text(encoding="utf-8").splitlines() if line.startswith(":::")]
    for directive in directives:
        module, _, name = directive.rpartition(".")
        assert _module_source(directive) is not None or _defines(_module_source(module), name), (
            f"::: {directive} names nothing in the source tree")
    missing = []
    for name in _public_names():
        documented = any(
            (directive.endswith("." + name) and _defines(_module_source(directive.rpartition(".")[0]), name))
            or _defines(_module_source(directive), name)
            for directive in directives)
        if not documented:
            missing.append(name)
    assert not missing, f"not in the API reference (docs/api/*.md): {missing}"


def test_docstring_examples_sections_are_named_examples():
    """mkdocstrings (griffe) reads a Google-style `Example:` as a note and renders its doctest lines as Markdown
    quotes; `Examples:` renders them as code."""
    offenders = [f"{path.relative_to(ROOT)}:{number}"
                 for folder in ("hetero_cs", "calibration") for path in sorted((ROOT / folder).rglob("*.py"))
                 for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                 if re.fullmatch(r"\s+Example:\s*", line)]
    assert not offenders, offenders


# ---- snippets ---------------------------------------------------------------------------------------------------


def _snippets(language: str) -> list[tuple[str, str]]:
    """(where, code) of every fenced block in that language: README, the pages, benchmarks/README.md (each file
    once, as written; included text is checked where it lives)."""
    found = []
    for path in [README, ROOT / "benchmarks" / "README.md"] + _pages():
        text = path.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            if match.group(3) == language:
                indent = len(match.group(1))
                code = "\n".join(line[indent:] for line in match.group(4).split("\n"))
                where = f"{path.relative_to(ROOT)}:{text[:match.start()].count(chr(10)) + 1}"
                found.append((where, code))
    return found


def test_the_python_snippets_compile():
    snippets = _snippets("python")
    assert len(snippets) >= 10
    for where, code in snippets:
        compile(code.replace("[...]", "[]"), where, "exec")


def _free_names(code: str) -> set[str]:
    assigned, loaded = set(), set()
    for node in ast.walk(ast.parse(code.replace("[...]", "[]"))):
        if isinstance(node, ast.Name):
            (assigned if isinstance(node.ctx, ast.Store) else loaded).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            assigned.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            assigned.add(node.name)
        elif isinstance(node, ast.arg):
            assigned.add(node.arg)
    return loaded - assigned - set(dir(builtins))


# The prelude a self-contained snippet may lean on: the pages write `hetero_cs.` after the quick start's import.
_PRELUDE = "import hetero_cs\n"


def _why_not_run(code: str) -> str | None:
    if "[...]" in code:
        return "has a [...] placeholder"
    free = _free_names(code) - {"hetero_cs"}
    if free:
        return f"uses names it does not define (the page's prose or an earlier snippet does): {sorted(free)}"
    if "Strategy(" in code and "emulate=" not in code:
        return "builds a strategy on the machine's GPUs"
    return None


def test_the_quick_start_on_emulated_devices_is_among_the_snippets_run():
    runnable = [code for _, code in _runnable()]
    assert any('emulate=["A10", "T4", "P100"]' in code and "model.fit(" in code for code in runnable), (
        "the quick start's emulated snippet is no longer run by test_self_contained_snippets_run")


def _what_if_commands() -> list[list[str]]:
    """The `hetero-cs plan` commands of the pages' bash blocks that need neither hardware nor files."""
    commands = []
    for _, code in _snippets("bash"):
        for line in code.splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["hetero-cs", "plan"] and "--devices" in words and not {"--profile", "--model"} & set(
                    words):
                commands.append(words[1:])
    return commands


def test_the_what_if_commands_run_without_tensorflow():
    from hetero_cs import cli

    commands = _what_if_commands()
    assert commands, "no `hetero-cs plan --devices ...` command in the docs' bash blocks"
    tensorflow_before = "tensorflow" in sys.modules
    for argv in commands:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = cli.main(argv)
        assert status in (0, None), f"hetero-cs {' '.join(argv)} exited with {status}"
        if "--json" in argv:
            plan = json.loads(out.getvalue())
            assert sum(plan["per_replica_batch_sizes"]) == int(argv[argv.index("--global-batch-size") + 1])
        else:
            assert out.getvalue().strip()
    if not tensorflow_before:
        assert "tensorflow" not in sys.modules, "`hetero-cs plan` without --model loaded TensorFlow"


def _runnable() -> list[tuple[str, str]]:
    return [(where, code) for where, code in _snippets("python") if _why_not_run(code) is None]


@pytest.mark.slow
@pytest.mark.parametrize("where,code", _runnable(), ids=[where for where, _ in _runnable()])
def test_self_contained_snippets_run(where, code, tmp_path):
    """Each python snippet that stands on its own runs, in a process of its own (logical devices are set up once
    per process), on the emulated devices it names. Emulated steps are shortened: the snippet's outcome, not its
    timing, is checked here."""
    pytest.importorskip("tensorflow")
    env = dict(os.environ, HETERO_CS_CACHE_DIR=str(tmp_path / "cache"), TF_CPP_MIN_LOG_LEVEL="2",
               HETERO_CS_EMULATION_TARGET_MAKESPAN_MS="10")
    done = subprocess.run([sys.executable, "-c", _PRELUDE + code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{where} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
