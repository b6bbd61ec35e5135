"""Safe defaults: safetensors only unless pickle is allowed (and then tensors only), no remote
code from a checkpoint, servers on 127.0.0.1, and the dashboard server inside its run directory."""
import ast
import http.client
import json
import shutil
import threading
from pathlib import Path
from urllib.parse import quote

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import EngineConfig, ModelConfig, RunConfig
from pipeline.dashboard.serve import make_server
from pipeline.cluster.actor import load_engine
from pipeline.engine import Engine, SamplingParams
from pipeline.model.loader import load_model
from tests.tiny_models import tiny_checkpoint

PACKAGE = Path(__file__).resolve().parents[1] / "pipeline"
# The demo builder loads only checkpoints it wrote itself (pipeline/demo); every other
# from_pretrained of an Auto class must say trust_remote_code=False.
OWN_CHECKPOINTS_ONLY = {"demo"}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return Path(tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt")), arch="llama", num_mtp_layers=1))


def copy_as_pickle(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    torch.save(load_file(str(dst / "model.safetensors")), dst / "pytorch_model.bin")
    (dst / "model.safetensors").unlink()
    return dst


def greedy(engine):
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, ignore_eos=True), gamma=1)
    return [o.token_ids for o in outs]


def test_pickle_weights_are_refused_unless_allowed(checkpoint, tmp_path):
    pickled = copy_as_pickle(checkpoint, tmp_path / "pickled")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin.*model\.allow_pickle=true"):
        load_model(pickled)
    with pytest.raises(FileNotFoundError, match="model.allow_pickle"):
        load_engine(ModelConfig(path=str(pickled), device="cpu"), EngineConfig())
    assert RunConfig.from_dict({"model": {"path": "m"}, "data": {"path": "d"},
                                "output": {"dir": "o"}}).model.allow_pickle is False
    allowed = load_engine(ModelConfig(path=str(pickled), device="cpu", allow_pickle=True),
                          EngineConfig(max_batch_size=2))
    assert greedy(allowed) == greedy(Engine.from_pretrained(checkpoint, device="cpu", max_batch_size=2))


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_allowed_pickle_still_runs_no_code(checkpoint, tmp_path):
    evil = copy_as_pickle(checkpoint, tmp_path / "evil")
    marker = tmp_path / "pwned"
    torch.save({"x": RunsCode(str(marker))}, evil / "pytorch_model.bin", _use_new_zipfile_serialization=True)
    with pytest.raises(FileNotFoundError):
        load_model(evil)                                   # refused without reading it
    with pytest.raises(Exception, match="(?i)weights.only|unpickl|unsupported"):
        load_model(evil, allow_pickle=True)                # torch.load(weights_only=True) refuses
    assert not marker.exists()


def test_remote_code_in_a_checkpoint_is_never_run(checkpoint, tmp_path):
    ckpt = tmp_path / "remote"
    shutil.copytree(checkpoint, ckpt)
    marker = tmp_path / "remote-code-ran"
    code = f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import LlamaConfig as EvilConfig\n"
    for name in ("configuration_evil.py", "modeling_evil.py", "tokenization_evil.py"):
        (ckpt / name).write_text(code)
    config = json.loads((ckpt / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (ckpt / "config.json").write_text(json.dumps(config))
    tok_cfg = ckpt / "tokenizer_config.json"
    tok = json.loads(tok_cfg.read_text()) if tok_cfg.exists() else {}
    tok["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    tok_cfg.write_text(json.dumps(tok))
    engine = Engine.from_pretrained(ckpt, device="cpu", max_batch_size=2)
    assert engine.tokenizer is not None and type(engine.model.hf_config).__name__ == "LlamaConfig"
    assert greedy(engine) == greedy(Engine.from_pretrained(checkpoint, device="cpu", max_batch_size=2))
    assert not marker.exists()


def calls(tree):
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def called_name(call) -> str:
    f = call.func
    return ast.unparse(f)


def sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_auto_classes_are_loaded_with_trust_remote_code_false():
    checked = 0
    for path in sources():
        for call in calls(ast.parse(path.read_text())):
            name = called_name(call)
            kw = {k.arg: k.value for k in call.keywords}
            if "trust_remote_code" in kw:                 # never anything but the literal False
                assert isinstance(kw["trust_remote_code"], ast.Constant) and kw["trust_remote_code"].value is False, \
                    f"{path}:{call.lineno}"
            if name.endswith(".from_pretrained") and name.split(".")[-2].startswith("Auto"):
                if path.relative_to(PACKAGE).parts[0] in OWN_CHECKPOINTS_ONLY:
                    continue
                assert "trust_remote_code" in kw, f"{path}:{call.lineno} {name} without trust_remote_code=False"
                checked += 1
    assert checked >= 3          # AutoConfig and AutoTokenizer in model/engine, bench's AutoModel


def test_every_server_binds_loopback(tmp_path):
    server = make_server(tmp_path, port=0)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.server_close()
    servers = ray_inits = 0
    for path in sources():
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                    for a in (n.names if isinstance(n, ast.Import) else [ast.alias(n.module or "")])}
        assert not imported & {"socket", "socketserver", "aiohttp", "uvicorn", "flask"}, path  # raw servers
        for call in calls(tree):
            name = called_name(call)
            if name.endswith(("HTTPServer", "TCPServer", "UDPServer", "create_server", "start_http_server")):
                host = call.args[0].elts[0] if call.args and isinstance(call.args[0], ast.Tuple) else None
                assert isinstance(host, ast.Constant) and host.value == "127.0.0.1", f"{path}:{call.lineno}"
                servers += 1
            if name == "ray.init":
                kw = {k.arg: k.value for k in call.keywords}
                if "address" not in kw:                   # a Ray the run starts: no dashboard server
                    assert ast.literal_eval(kw["include_dashboard"]) is False, f"{path}:{call.lineno}"
                    ray_inits += 1
    assert servers >= 1 and ray_inits >= 1


@pytest.fixture
def served(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "outputs").mkdir(parents=True)
    (run_dir / "outputs" / "inside.txt").write_text("inside")
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the run directory")
    server = make_server(run_dir, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], secret
    server.shutdown()
    server.server_close()


def get(port, target):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("GET", target, skip_host=True, skip_accept_encoding=True)   # sent verbatim
    conn.putheader("Host", "127.0.0.1")
    conn.endheaders()
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, body


def traversals(secret: Path):
    a = str(secret.resolve())
    up = "/".join([".."] * len(secret.resolve().parts))
    return [a, "/" + a, quote(a, safe=""), "/" + quote(a, safe=""), "/%2F" + a.lstrip("/"),
            f"/{up}{a}", "/" + quote(f"{up}{a}", safe=""), f"/outputs/../../{secret.name}",
            f"/%2e%2e/{secret.name}", f"/%2E%2E%2F{secret.name}", f"/%252e%252e/{secret.name}",
            f"/..%5c{secret.name}", f"/..\\{secret.name}", f"http://127.0.0.1/../{secret.name}",
            f"file://{a}", f"/outputs/%2e%2e/%2e%2e/{secret.name}"]


def test_the_server_serves_its_run_directory_only(served):
    port, secret = served
    assert get(port, "/outputs/inside.txt") == (200, b"inside")   # the files it should serve
    for target in traversals(secret):
        status, body = get(port, target)
        assert status in (400, 404) and b"outside" not in body, target
