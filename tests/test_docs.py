"""The documentation site: it builds with --strict (a broken link, a missing anchor, a page missing from the nav or a
docstring that does not render fails), the README's links exist, and the recipe-key reference generated from the
code lists every key the config accepts, each with its description. The pages' commands: tests/test_readme.py."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fullband.configio import from_dict
from fullband.errors import ConfigError
from fullband.rl.run import RLRecipe
from fullband.train.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def hooks():
    """docs/hooks.py (the site's hooks: the README as home page, the generated key reference)."""
    spec = importlib.util.spec_from_file_location("fullband_docs_hooks", ROOT / "docs" / "hooks.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the site needs the docs extra (pip install -e '.[docs]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    keys = (tmp_path / "site" / "reference" / "keys" / "index.html").read_text()
    assert all(f"{k.section}.{k.name}" in keys for k in hooks().recipe_keys())
    home = (tmp_path / "site" / "index.html").read_text()
    assert "make demo" in home and 'src="demo/race.png"' in home


def test_every_relative_link_of_the_readme_exists():
    """The README's links are repository paths (they work on GitHub) inside docs/ (the site follows them)."""
    text = (ROOT / "README.md").read_text()
    links = [link for link in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:|#", link)]
    assert len(links) > 20
    for link in links:
        path = link.partition("#")[0]
        assert (ROOT / path).exists(), f"README links {link}, which does not exist"
        assert path.startswith("docs/"), f"README links {link}, outside docs/: the site cannot follow it"


def accepted_keys(recipe: type, section: str) -> list[str]:
    """The keys a recipe section accepts, as the config's own error for an unknown key lists them."""
    with pytest.raises(ConfigError) as err:
        from_dict(recipe, {section: {"no_such_key": 1}})
    listed = re.search(rf"accepted in \[{section}\]: (.*)$", str(err.value))
    assert listed, str(err.value)
    return listed.group(1).split(", ")


def test_the_key_reference_lists_every_key_the_config_accepts():
    docs = hooks()
    table = docs.keys_markdown()
    rows = {(k.section, k.name): k for k in docs.recipe_keys()}
    sections = {"model": RunConfig, "data": RunConfig, "train": RunConfig, "optim": RunConfig, "log": RunConfig,
                "rl": RLRecipe}
    assert sorted(docs.sections()) == sorted(sections)
    for section, recipe in sections.items():
        accepted = accepted_keys(recipe, section)
        assert sorted(name for s, name in rows if s == section) == sorted(accepted), section
        for name in accepted:
            key = rows[section, name]
            assert key.what, f"{section}.{name} has no comment in the code: the reference cannot say what it does"
            assert key.accepted and key.default
            assert f"| `{section}.{name}` | `{key.default}` |" in table


def test_the_key_reference_states_the_checks():
    """What a key accepts is read from its checks: a choice lists the values, a range its bounds, named when they
    depend on another key."""
    rows = {f"{k.section}.{k.name}": k for k in hooks().recipe_keys()}
    assert rows["model.fusion"].accepted == '`"gated"`, `"additive"`, `"concat"`, `"t2mlr"`, `"none"`'
    assert rows["model.feedback_target"].accepted == "an integer 0 <= feedback_target < n_layers"
    assert rows["train.warmup_steps"].accepted == "an integer 0 <= warmup_steps < steps + 1"
    assert rows["data.val_percent"].accepted == "0 < val_percent < 100"
    assert rows["log.eval_passes"].accepted == "each item: an integer >= 1"
    assert rows["train.memory_check"].accepted == "true or false"
    assert rows["train.passes"].default == '"paper-200b"'
    assert rows["train.blend_until"].what.startswith("the blend curriculum")
