"""Bad input to ``lds-train`` and ``lds-sample``: each mistake is one paragraph naming the setting, exit code 2,
no traceback, found before any training process starts, and (but for the few that need torch) before torch or
Lightning is imported.

The battery (``CASES``) runs in two fresh Python processes, which then report whether torch or Lightning was
imported (the checks take ~1 s, the imports ~9 s): the issue's cases through ``lds-train``'s whole entry point
(Hydra's argument parsing, the checks, the run folder, the message, the exit code), the others through its
configuration check on Hydra's compose. The cases that need torch (``TORCH_CASES``) run
in this process through ``prepare_training`` (what ``lds-train`` does before ``fit``); a few tests run the real
console scripts, for what only they do (the console script, two devices, the prefix of ``lds-sample``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from lightning_deepseek.app.cli import run_sampling
from lightning_deepseek.app.errors import user_errors_exit
from lightning_deepseek.app.run import CONFIG_DIR, RunFolder
from lightning_deepseek.app.training import prepare_training
from lightning_deepseek.models import PRESETS, GPTConfig, LightningGPT
from tests.helpers import Background

BIN = Path(sys.executable).parent
BASE = ["model=tiny", "trainer.devices=1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("inputs")
    (root / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (root / "empty.txt").write_text("")
    (root / "latin1.txt").write_bytes("café crème".encode("latin-1") * 10)
    (root / "tiny.txt").write_text("just a few words")
    (root / "no-text").mkdir()
    (root / "no-text" / "image.png").write_bytes(b"\x89PNG")
    (root / "empty-run" / "checkpoints").mkdir(parents=True)
    (root / "not-torch.ckpt").write_bytes(b"PK-not-a-zip")
    small = LightningGPT(GPTConfig(**PRESETS["small"]))
    torch.save({"state_dict": {}, "hyper_parameters": dict(small.hparams)}, root / "small.ckpt")
    return root


def _case(args: str, needle: str, **marks: object) -> object:
    return pytest.param(args, needle, id=args[:60], **marks)


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
CASES = [
    _case("trainer.max_steps=0", "trainer.max_steps=0 is not valid: it must be a positive whole number"),
    _case("trainer.max_steps=-5", "trainer.max_steps=-5 is not valid"),
    _case("trainer.max_steps=abc", "trainer.max_steps='abc' is not valid"),
    _case("+trainer.precision=16", "trainer.precision=16 would be overwritten: lds-train sets the Trainer's precision "
                                   "from precision=fp32|fp16|bf16|staged"),
    _case("+trainer.strategy=ddp", "trainer.strategy=ddp would be overwritten"),
    _case("+trainer.callbacks=[]", "trainer.callbacks=[] would be overwritten"),
    _case("+trainer.max_step=5", "trainer.max_step is not an argument of Lightning's Trainer: did you mean "
                                 "trainer.max_steps?"),
    _case("data.batch_size=abc", "data.batch_size='abc' is not valid: it must be a positive whole number"),
    _case("data.batch_size=0", "data.batch_size=0 is not valid"),
    _case("data.batch_size=1.5", "data.batch_size=1.5 is not valid"),
    _case("trainer.devices=0", "trainer.devices=0 asks for no device: use a positive count"),
    _case("trainer.devices=-3", "trainer.devices=-3 asks for no device"),
    _case("trainer.devices=4096", "trainer.devices=4096 but this machine has"),
    _case("trainer.devices=abc", "trainer.devices='abc' is not a device count"),
    _case("trainer.devices=1.5", "trainer.devices=1.5 is not a device count"),
    _case("trainer.log_every_n_steps=0", "trainer.log_every_n_steps=0 is not valid"),
    _case("trainer.val_check_interval=0", "trainer.val_check_interval=0 is not valid"),
    _case("trainer.val_check_interval=abc", "trainer.val_check_interval='abc' is not valid"),
    _case("trainer.limit_val_batches=-1", "trainer.limit_val_batches=-1 is not valid"),
    _case("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1 is not valid"),
    _case("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0 is not valid"),
    _case("trainer.num_nodes=0", "trainer.num_nodes=0 is not valid"),
    _case("trainer.enable_progress_bar=maybe", "trainer.enable_progress_bar='maybe' is not valid: it must be true or "
                                               "false"),
    _case("data.val_fraction=0", "data.val_fraction=0 is not valid: it must be a fraction strictly between 0 and 1"),
    _case("data.val_fraction=1.5", "data.val_fraction=1.5 is not valid"),
    _case("data.num_workers=-1", "data.num_workers=-1 is not valid"),
    _case("data.block_size=100000", "data.block_size=100000 exceeds model.block_size=64"),
    _case("data.block_size=abc", "data.block_size='abc' is not valid"),
    _case("data.path=/nonexistent/corpus.txt", "data.path='/nonexistent/corpus.txt' does not exist"),
    _case("data.path={files}/blob.bin", "looks like a binary file"),
    _case("data.path={files}/empty.txt", "is empty. Point data.path at a file with text in it"),
    _case("data.path={files}/latin1.txt", "is not UTF-8 text"),
    _case("data.path={files}/tiny.txt", "the training split has"),
    _case("data.path={files}/no-text", "is a folder with no text files"),
    _case("optim.learning_rate=0", "optim.learning_rate=0 is not valid: it must be a positive number"),
    _case("optim.learning_rate=abc", "optim.learning_rate='abc' is not valid"),
    _case("optim.weight_decay=-1", "optim.weight_decay=-1 is not valid"),
    _case("optim.warmup_steps=1.5", "optim.warmup_steps=1.5 is not valid"),
    _case("optim.min_lr_ratio=2", "optim.min_lr_ratio=2 is not valid"),
    _case("+optim.learnig_rate=0.1", "optim.learnig_rate is not an optimizer setting: did you mean "
                                     "optim.learning_rate?"),
    _case("+optim.lr=0.1", "optim.lr is not an optimizer setting: the settings are"),
    _case("model.preset=huge", "model.preset='huge' is not a known preset"),
    _case("model.n_layer=0", "model.n_layer=0 is not valid"),
    _case("model.n_layer=abc", "model.n_layer='abc' is not valid"),
    _case("model.n_head=3", "model.n_embd=64 is not divisible by model.n_head=3"),
    _case("model.dropout=1.5", "model.dropout=1.5 must lie in [0, 1)"),
    _case("seed=abc", "seed='abc' is not valid: it must be a whole number"),
    _case("plot=maybe", "plot='maybe' is not valid: it must be true or false"),
    _case("checkpoint.every_n_steps=0", "checkpoint.every_n_steps=0 is not valid"),
    _case("resume=/nonexistent/last.ckpt", "resume='/nonexistent/last.ckpt' does not exist"),
    _case("resume={readme}", "resume='{readme}': {readme} is not a checkpoint (not a file that torch.save writes)"),
    _case("resume={files}/not-torch.ckpt", "not-torch.ckpt is not a checkpoint (not a file that torch.save writes)"),
    _case("resume={files}/empty-run", "is a folder with no complete checkpoint"),
    _case("resume={files}/no-text", "is a folder with no complete checkpoint"),
    _case("hydra.run.dir=/proc/x", "hydra.run.dir='/proc/x' cannot be created"),
    _case("data.path=~/no-books/", "data.path='{home}/no-books/' does not exist"),  # the shell's ~ (Hydra's: delete)
]
# Settings whose mistake only torch or instantiating a _target_ reveals (run.check_with_torch, prepare_training).
TORCH_CASES = [
    _case("resume={files}/small.ckpt", "holds a model of another shape: block_size 128 (this run: 64), n_layer 4 "
                                       "(this run: 2), n_embd 128 (this run: 64). Resume with model=small"),
    _case("+strategy.tensor_paralel_size=2", "unknown argument tensor_paralel_size=2: did you mean "
                                             "tensor_parallel_size?"),
    _case("+callbacks.extra._target_=no.such.Callback", "no.such.Callback"),
    _case("trainer.accelerator=gpu", "trainer.accelerator=gpu but this machine has no GPU", marks=NO_GPU),
]
README = Path(__file__).resolve().parents[2] / "README.md"

# The cases (and the ones only the command line shows: `~`, hydra.run.dir) run lds-train's whole entry
# point; the others its configuration check (cli.check_training_config) on Hydra's compose, once each: the entry
# point composes twice per run, which is most of a case's ~0.5 s.
ENTRY_CASES = {"trainer.max_steps=0", "+trainer.precision=16", "+trainer.max_step=5", "data.batch_size=abc",
               "trainer.devices=0", "data.path=/nonexistent/corpus.txt", "resume={readme}", "hydra.run.dir=/proc/x",
               "data.path=~/no-books/"}

# Runs the cases in this (fresh) process; prints each exit code and stderr, and the torch and Lightning modules
# imported by the end.
_BATTERY = """
import contextlib, io, json, sys
from pathlib import Path
from hydra import compose, initialize_config_dir
from lightning_deepseek.app import cli
from lightning_deepseek.app.run import CONFIG_DIR, RunFolder

def run(job):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            if job["entry"]:
                sys.argv = ["lds-train", *job["argv"], *job["run_dir"]]
                cli.train()  # the console script's own target ends the process (console.py): not in here
            else:
                cfg = compose("train", overrides=job["argv"])
                cli.check_training_config(cfg, RunFolder(Path(job["run_dir"][0].split("=", 1)[1]), False))
            code = 0
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue()

jobs = json.loads(sys.argv[1])
results = {}
with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
    results.update({i: run(job) for i, job in enumerate(jobs) if not job["entry"]})
results.update({i: run(job) for i, job in enumerate(jobs) if job["entry"]})
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning"))
print(json.dumps({"results": [results[i] for i in range(len(jobs))], "heavy": heavy}))
"""


def _fill(text: str, files: Path, home: Path) -> str:
    return text.format(files=files, readme=README, home=home)


@pytest.fixture(scope="module")
def battery(files: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every case of ``CASES``, in processes that never import torch."""
    runs, home = tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("home")
    jobs = []
    for i, case in enumerate(CASES):
        args = _fill(case.values[0], files, home).split()
        run_dir = [] if any(a.startswith("hydra.run.dir=") for a in args) else [f"hydra.run.dir={runs / str(i)}"]
        jobs.append({"entry": case.values[0] in ENTRY_CASES, "argv": [*BASE, *args], "run_dir": run_dir})
    # Two processes at once, each taking every other case (CI has two cores).
    procs = [subprocess.Popen([sys.executable, "-c", _BATTERY, json.dumps(jobs[half::2])], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=runs, env={**os.environ, "HOME": str(home)})
             for half in (0, 1)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    halves = [json.loads(out.splitlines()[-1]) for out, _ in outputs]
    report = {"results": [None] * len(jobs), "heavy": sorted({m for half in halves for m in half["heavy"]})}
    report["results"][0::2], report["results"][1::2] = halves[0]["results"], halves[1]["results"]
    report["ids"] = {case.id: (i, runs / str(i)) for i, case in enumerate(CASES)}
    report["home"] = home
    return report


def test_configuration_checks_import_neither_torch_nor_lightning(battery: dict) -> None:
    assert battery["heavy"] == []  # every case above was found with Hydra, OmegaConf and our light modules only


@pytest.mark.parametrize("args, needle", CASES)
def test_bad_setting_is_one_paragraph_and_exit_2(args: str, needle: str, battery: dict, files: Path,
                                                  request: pytest.FixtureRequest) -> None:
    index, run_dir = battery["ids"][request.node.callspec.id]
    code, err = battery["results"][index]
    assert code == 2, err
    _assert_one_paragraph(err, "lds-train: error: ", _fill(needle, files, battery["home"]))
    if run_dir.exists():  # a folder the user named is kept (its log) and marked
        assert (run_dir / "FAILED").is_file()


@pytest.mark.parametrize("args, needle", TORCH_CASES)
def test_bad_setting_found_with_torch_is_one_paragraph_and_exit_2(args: str, needle: str, files: Path,
                                                                   tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    overrides = [*BASE, *args.format(files=files).split()]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"run_dir={tmp_path / 'run'}"])
    folder = RunFolder(tmp_path / "run", named_by_hydra=False)
    with pytest.raises(SystemExit) as exited:
        user_errors_exit()(prepare_training)(cfg, folder)
    assert exited.value.code == 2
    _assert_one_paragraph(capsys.readouterr().err, "lds-train: error: ", needle.format(files=files))


def _assert_one_paragraph(err: str, prefix: str, needle: str) -> None:
    assert "Traceback" not in err
    message = err[err.index(prefix):]
    assert "\n\n" not in message.strip() and message.count(prefix) == 1
    assert needle in " ".join(message.split()), message


@pytest.mark.parametrize("args, needle", [
    ("ckpt=null", "ckpt is not set. Pass ckpt=PATH"),
    ("ckpt=/nonexistent.ckpt", "ckpt='/nonexistent.ckpt' does not exist"),
    ("ckpt=README.md", "ckpt='README.md': README.md is not a checkpoint (not a file that torch.save writes)"),
    ("ckpt={files}/not-torch.ckpt", "not-torch.ckpt is not a checkpoint (not a file that torch.save writes)"),
    ("ckpt={files}/empty-run", "is a folder with no complete checkpoint in it"),
    ("ckpt={files}/small.ckpt max_new_tokens=0", "max_new_tokens=0 must be a positive whole number"),
    ("ckpt={files}/small.ckpt temperature=0", "temperature=0 must be a positive number"),
])
def test_sample_errors_say_lds_sample(args: str, needle: str, files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("sample", overrides=args.format(files=files).split())
    with pytest.raises(SystemExit) as exited:
        run_sampling(cfg)
    assert exited.value.code == 2
    _assert_one_paragraph(capsys.readouterr().err, "lds-sample: error: ", needle.format(files=files))


# -- the real console scripts -------------------------------------------------------------------------------

def _run(script: str, *args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / script), *args], capture_output=True, text=True, timeout=240, cwd=cwd,
                          env={**os.environ, **(env or {})})


def test_lds_train_reports_once_before_importing_torch_and_leaves_no_folder(tmp_path: Path) -> None:
    # The console script itself, on two devices: an error found after the processes started would print once per
    # rank; -X importtime lists every module it imported.
    result = subprocess.run([sys.executable, "-X", "importtime", str(BIN / "lds-train"), "model=tiny",
                             "trainer.devices=2", "trainer.max_steps=0"], capture_output=True, text=True, timeout=240,
                            cwd=tmp_path)
    assert result.returncode == 2
    imported = [line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")]
    assert "hydra" in imported and not [m for m in imported if m.split(".")[0] in ("torch", "lightning")]
    message = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("import time:"))
    _assert_one_paragraph(message, "lds-train: error: ", "trainer.max_steps=0 is not valid")
    assert not list(tmp_path.glob("outputs/*/*"))  # Hydra's folder for this run is gone


def test_sample_prefix(tmp_path: Path) -> None:
    result = _run("lds-sample", f"ckpt={tmp_path}", cwd=tmp_path)
    assert result.returncode == 2
    _assert_one_paragraph(result.stderr, "lds-sample: error: ", "is a folder with no complete checkpoint")


@pytest.fixture(scope="module", autouse=True)
def running_ranks_error(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Background]:
    """The run of ``test_an_error_found_by_the_running_ranks_is_printed_once``, started with the module: its two
    ranks import torch one after the other (~20 s on one core) while the battery and the other tests run."""
    cwd = tmp_path_factory.mktemp("running-ranks")
    run = Background([str(BIN / "lds-train"), "model=tiny", "strategy=ddp", "compression=none", "trainer.devices=2",
                      "trainer.max_steps=4", "precision=staged", "plot=false",
                      "precision.plugin.schedule=[{precision: 32-true, until: 50}, {precision: bf16-mixed}]",
                      "hydra.run.dir=run"], cwd / "logs", cwd=cwd)
    yield run
    run.kill()


def test_an_error_found_by_the_running_ranks_is_printed_once(running_ranks_error: Background) -> None:
    # A precision schedule past the run's end is only known once the plugin sees the trainer (in every rank).
    result = running_ranks_error.finish()
    assert result.returncode == 2, result.stderr[-3000:]
    _assert_one_paragraph(result.stderr, "lds-train: error: ", "until=50 step ends at optimizer step 50")


def test_trainer_arguments_read_from_lightnings_source_equal_its_signature() -> None:
    import inspect

    import lightning.pytorch as pl

    from lightning_deepseek.app.config_checks import trainer_arguments

    assert trainer_arguments() == set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}
