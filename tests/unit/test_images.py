"""Every image the chart and the examples name is one the Dockerfile builds.

Static: there is no container engine on the test machines, so nothing is
built or pulled. The Dockerfile is parsed instead, with this rule for what a
build target produces: a stage builds the image named by its
``dev.spotguard.image`` label (a repository without tag, e.g.
``spotguard/spotguard-torch``), inherited from the stage it is built ``FROM``
as Docker inherits labels; a stage without the label builds no image of ours.
Images are tagged with the project's version, so every name must carry that
tag. The chart is rendered by the real helm binary (as in test_chart.py).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "spotguard"
DOCKERFILE = ROOT / "Dockerfile"
EXAMPLES = ROOT / "examples"
IMAGE_LABEL = "dev.spotguard.image"


# -- the Dockerfile, parsed (pure) ----------------------------------------------------


@dataclass
class Stage:
    """One ``FROM`` of a Dockerfile: its name, base, labels and instructions."""

    name: str | None
    base: str
    labels: dict[str, str] = field(default_factory=dict)
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)

    @property
    def image(self) -> str | None:
        return self.labels.get(IMAGE_LABEL)


def dockerfile_instructions(text: str) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: continuation lines joined, comments dropped."""
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#"):
            continue  # a comment, also inside a continued instruction (as Docker reads it)
        if not line and not current:
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            yield word.upper(), rest.strip()
        current = ""
    if current.strip():
        word, _, rest = current.strip().partition(" ")
        yield word.upper(), rest.strip()


def parse_labels(args: str) -> dict[str, str]:
    """``LABEL a=1 "b"="two words"`` and the legacy ``LABEL key value``."""
    tokens = shlex.split(args)
    if tokens and "=" not in tokens[0]:
        return {tokens[0]: " ".join(tokens[1:])}
    out: dict[str, str] = {}
    for tok in tokens:
        key, sep, value = tok.partition("=")
        if not sep:
            raise ValueError(f"LABEL {args!r}: {tok!r} is not key=value")
        out[key] = value
    return out


def parse_dockerfile(text: str) -> list[Stage]:
    """The stages of a Dockerfile, labels inherited from a ``FROM <stage>``."""
    stages: list[Stage] = []
    for instr, args in dockerfile_instructions(text):
        if instr == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            base = words[0]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            parent = next((s for s in stages if s.name is not None and s.name == base.lower()), None)
            stages.append(Stage(name.lower() if name else None, base, dict(parent.labels) if parent else {}))
        elif stages:
            stages[-1].instructions.append((instr, args))
            if instr == "LABEL":
                stages[-1].labels.update(parse_labels(args))
    return stages


def built_images(stages: list[Stage]) -> dict[str, Stage]:
    """Image repository -> the target that builds it."""
    out: dict[str, Stage] = {}
    for s in stages:
        if s.image is None:
            continue
        assert s.name, f"the stage building {s.image} has no name: `docker build --target` cannot pick it"
        assert "$" not in s.image, f"{IMAGE_LABEL} of {s.name} must be literal, not {s.image!r}"
        assert s.image not in out, f"{s.image} is built by two targets: {out[s.image].name} and {s.name}"
        out[s.image] = s
    return out


def split_image(ref: str) -> tuple[str, str | None]:
    """``registry:5000/repo/name:tag@digest`` -> (repository, tag or None)."""
    ref = ref.split("@", 1)[0]
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    if colon > slash:
        return ref[:colon], ref[colon + 1 :]
    return ref, None


def images_in(tree: Any) -> Iterator[str]:
    """Every ``image:`` value and every ``--image=`` argument in a YAML tree."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key == "image" and isinstance(value, str):
                yield value
            else:
                yield from images_in(value)
    elif isinstance(tree, list):
        for value in tree:
            if isinstance(value, str) and value.startswith("--image="):
                yield value.removeprefix("--image=")
            else:
                yield from images_in(value)


DOCKERFILE_CASES = [
    ("no stages", "# nothing\n", {}),
    ("one labelled stage", 'FROM python:3.11 AS app\nLABEL dev.spotguard.image="a/b"\n', {"a/b": "app"}),
    (
        "continuation lines, several labels, legacy form",
        "FROM x AS one\nLABEL k=v \\\n  # a comment inside\n  dev.spotguard.image=a/one\n"
        "FROM x AS two\nLABEL dev.spotguard.image a/two\n",
        {"a/one": "one", "a/two": "two"},
    ),
    (
        "a label is inherited from the stage built FROM, and may be overridden",
        "FROM x AS base\nLABEL dev.spotguard.image=a/base\nFROM base AS kid\nRUN true\n"
        "FROM base AS other\nLABEL dev.spotguard.image=a/other\n",
        None,  # base and kid both claim a/base: an error
    ),
    (
        "an unlabelled stage builds nothing of ours; --platform is skipped",
        "ARG V=1\nFROM --platform=linux/amd64 x AS builder\nRUN make\n"
        "FROM builder AS final\nLABEL dev.spotguard.image=a/final\n",
        {"a/final": "final"},
    ),
]


@pytest.mark.parametrize(("case", "text", "expected"), DOCKERFILE_CASES, ids=[c[0] for c in DOCKERFILE_CASES])
def test_parse_dockerfile(case: str, text: str, expected: dict[str, str] | None) -> None:
    stages = parse_dockerfile(text)
    if expected is None:
        with pytest.raises(AssertionError, match="built by two targets"):
            built_images(stages)
        return
    assert {img: s.name for img, s in built_images(stages).items()} == expected


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("spotguard/spotguard:0.1.0", ("spotguard/spotguard", "0.1.0")),
        ("registry:5000/ml/spotguard-torch:1.2", ("registry:5000/ml/spotguard-torch", "1.2")),
        ("registry:5000/ml/spotguard", ("registry:5000/ml/spotguard", None)),
        ("spotguard/spotguard:0.1.0@sha256:abc", ("spotguard/spotguard", "0.1.0")),
    ],
)
def test_split_image(ref: str, expected: tuple[str, str | None]) -> None:
    assert split_image(ref) == expected


# -- the repository's own files ---------------------------------------------------------


def helm(*args: str) -> str:
    """Run the helm binary the test environment provides (as test_chart.py does)."""
    from testenv.cluster import bin_dir
    from testenv.require import require_tool

    exe = require_tool("helm", path=bin_dir() / "helm")
    return subprocess.run([exe, *args], capture_output=True, text=True, check=True, timeout=120).stdout


def project_version() -> str:
    version: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return version


def repo_images() -> dict[str, Stage]:
    return built_images(parse_dockerfile(DOCKERFILE.read_text()))


def values_files() -> list[Path]:
    """The Helm values files among the examples (YAML without apiVersion/kind)."""
    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        if docs and all(isinstance(d, dict) and "kind" not in d for d in docs):
            out.append(path)
    return out


# Values that switch on every optional template, so that each one is rendered.
ALL_FEATURES = [
    "webhook.enabled=true",
    "replicaCount=2",
    "prometheusRule.enabled=true",
    "grafanaDashboard.enabled=true",
    "metrics.serviceMonitor.enabled=true",
    "metrics.podMonitor.enabled=true",
]


def chart_images() -> dict[str, str]:
    """image -> where it was seen, over renders of the chart with its defaults,
    every optional template on, and each values file of the examples."""
    renders: list[tuple[str, list[str]]] = [("chart defaults", []), ("chart, every template on", [])]
    for s in ALL_FEATURES:
        renders[1][1].extend(["--set", s])
    for path in values_files():
        renders.append((f"chart with -f examples/{path.name}", ["-f", str(path)]))
    found: dict[str, str] = {}
    for where, args in renders:
        out = helm("template", "rel", str(CHART), "--namespace", "spotguard-system", *args)
        docs = [d for d in yaml.safe_load_all(out) if d]
        for d in docs:
            for image in images_in(d):
                found.setdefault(image, f"{where}: {d['kind']} {d['metadata']['name']}")
    return found


def example_images() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for d in yaml.safe_load_all(path.read_text()):
            for image in images_in(d or {}):
                found.setdefault(image, f"examples/{path.name}")
    return found


def test_dockerfile_builds_the_operator_and_the_trainer_image() -> None:
    images = repo_images()
    assert "spotguard/spotguard" in images and "spotguard/spotguard-torch" in images, (
        f"the Dockerfile builds {sorted(images)}: the operator image and the trainer image are both needed"
    )
    # A plain `docker build .` builds the last stage: keep it the operator image.
    assert parse_dockerfile(DOCKERFILE.read_text())[-1].image == "spotguard/spotguard"


def test_every_image_the_chart_and_examples_name_is_built() -> None:
    images = repo_images()
    version = project_version()
    named = {**chart_images(), **example_images()}
    from spotguard.operator.podbuilder import DEFAULT_IMAGE

    named.setdefault(DEFAULT_IMAGE, "the operator's default (--image)")
    assert any("torch" in i for i in named), "the trainer image of examples/trainingjob.yaml was not found"
    problems = []
    for image, where in sorted(named.items()):
        repo, tag = split_image(image)
        if repo not in images:
            problems.append(f"{image} ({where}): no Dockerfile target builds {repo}; targets build {sorted(images)}")
        elif tag != version:
            problems.append(f"{image} ({where}): tag {tag!r}, but images are tagged with the version {version}")
    assert not problems, "\n".join(problems)


def test_trainer_image_carries_what_the_example_runs() -> None:
    """The example's trainer runs ``python -m <module>`` from spotguard[torch],
    in the image whose torch wheel a build argument picks."""
    images = repo_images()
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for d in yaml.safe_load_all(path.read_text()):
            if not isinstance(d, dict) or d.get("kind") != "TrainingJob":
                continue
            for c in d["spec"]["template"]["spec"]["containers"]:
                stage = images[split_image(c["image"])[0]]
                runs = " ".join(a for i, a in stage.instructions if i == "RUN")
                extras = re.search(r"\.whl\)?\[([a-z,]+)\]", runs)
                installed = set(extras.group(1).split(",")) if extras else set()
                assert "torch" in installed, f"{stage.name} does not install spotguard[torch]"
                # The framework examples (train_hf, train_lightning) run in the same image.
                assert {"hf", "lightning"} <= installed, f"{stage.name}: no framework extras"
                args = {a.split("=")[0].split()[0] for i, a in stage.instructions if i == "ARG"}
                assert "TORCH_VARIANT" in args, f"{stage.name}: no build argument picks the CPU or CUDA torch wheel"
                assert any(i == "COPY" and a.split()[0] == "examples" for i, a in stage.instructions), (
                    f"{stage.name} does not carry the examples"
                )
                cmd = c["command"]
                if cmd[:2] == ["python", "-m"]:
                    module = ROOT / (cmd[2].replace(".", "/") + ".py")
                    assert module.is_file() and cmd[2].startswith("spotguard."), f"{path.name}: {cmd[2]} not packaged"


def test_readme_says_how_to_build_push_and_set_each_image() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("## On a real cluster", 1)[1].split("\n## ", 1)[0]
    for image, stage in repo_images().items():
        assert f"--target {stage.name}" in section, f"README's real-cluster section never builds {image}"
    assert "docker push" in section
    assert "--set image.repository=" in section


def test_trainer_image_keeps_the_torch_of_its_variant() -> None:
    """Every pip install after the variant's torch is constrained to that torch: an extra that asks
    for another version fails the build instead of pulling PyPI's default (CUDA) build."""
    stage = repo_images()["spotguard/spotguard-torch"]
    runs = [a for i, a in stage.instructions if i == "RUN" and "pip install" in a]
    torch_at = next(k for k, r in enumerate(runs) if "--index-url" in r and r.rstrip().endswith("torch"))
    later = runs[torch_at + 1 :]
    assert later, "nothing is installed after torch"
    assert "pip freeze | grep -i '^torch==' > /tmp/torch.txt" in later[0], "the installed torch is not pinned"
    for run in later:
        for install in run.split("pip install")[1:]:
            assert install.lstrip().startswith("-c /tmp/torch.txt"), f"unconstrained: pip install{install[:80]}"
