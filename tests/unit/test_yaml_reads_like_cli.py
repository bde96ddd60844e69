"""A value in a job YAML means what the same text means on the command line / in the environment.

PyYAML's YAML 1.1 resolvers read `max_restarts: 010` as 8, `1_0` as 10, `0x10` as 16, `yes`/`on`
as true and `2026-01-02` as a date, while `--max-restarts 010` is 10 and `1_0` is refused.  Each
case below runs the real `leto-run --print-config` twice -- the value from the YAML file and the
same text from the command line (or, for a switch, its environment variable) -- and requires the
same resolved config, or the same refusal (key and problem).
"""
import re

import pytest
from click.testing import CliRunner

from leto_run.cli import cli
from leto_run.config_load import OPTIONS
from leto_run.inject import KINDS

# What YAML 1.1 reads differently from the CLI (octal, `_`, hex, binary, base 60, booleans,
# dates, `=`), plus the plain decimal forms that must keep working.
TEXTS = ("010", "0010", "-010", "+010", "1_0", "0x10", "0b10", "0o10", "1:4", "010.5", "1_0.5",
         "1e3", "yes", "no", "on", "off", "Yes", "OFF", "2026-01-02", "=", "10", "0.5")
SWITCH_TEXTS = ("yes", "no", "on", "off", "Yes", "OFF", "y", "n", "true", "false", "True",
                "1", "0", "010")


def _run(args, env):
    r = CliRunner().invoke(cli, [*args, "--print-config", "x.py"], obj={"env": env})
    out = r.stdout if r.exit_code == 0 else r.stderr
    # the fresh rendezvous id and where a value came from differ by construction
    out = re.sub(r"\n  id: \S+", "\n  id: ID", out)
    out = re.sub(r"^(leto-run: error: [\w.\[\]]+) \([^)]*\)", r"\1", out, flags=re.M)
    return r.exit_code, out


def _key(err: str) -> str:
    return re.search(r"error: ([\w.\[\]]+)", err).group(1)


def _yaml(tmp_path, body: str) -> str:
    p = tmp_path / "job.yaml"
    p.write_text(body)
    return str(p)


def _same(tmp_path, key, text, cli_args, env):
    sec, name = key.split(".")
    from_yaml = _run(["--config", _yaml(tmp_path, f"{sec}:\n  {name}: {text}\n")], {})
    from_cli = _run(cli_args, env)
    assert from_yaml[0] == from_cli[0], (key, text, from_yaml, from_cli)
    if from_yaml[0] == 0:
        assert from_yaml[1] == from_cli[1], f"{key}: {text}"
    else:   # refused both ways, naming the same key (a YAML number may be refused by type)
        assert from_yaml[0] == 2 and _key(from_yaml[1]) == _key(from_cli[1]), (key, text)


VALUE_OPTIONS = [o for o in OPTIONS if o.kind == "value" and o.flags]
SWITCH_OPTIONS = [o for o in OPTIONS if o.kind in ("flag", "bool_pair") and o.env]


@pytest.mark.parametrize("opt", VALUE_OPTIONS, ids=lambda o: o.key)
def test_every_option_reads_yaml_text_as_the_cli_reads_it(tmp_path, opt):
    flag = next(f for f in opt.flags if f.startswith("--"))
    for text in TEXTS:
        _same(tmp_path, opt.key, text, [flag, text], {})


@pytest.mark.parametrize("opt", SWITCH_OPTIONS, ids=lambda o: o.key)
def test_every_switch_reads_yaml_text_as_its_environment_variable(tmp_path, opt):
    for text in SWITCH_TEXTS:
        _same(tmp_path, opt.key, text, [], {opt.env[0]: text})


def test_the_reported_values_are_ten_not_eight(tmp_path):
    for key, text, want in (("launch.max_restarts", "010", "max_restarts: 10\n"),
                            ("recovery.hang_timeout", "010", "hang_timeout: 10.0\n"),
                            ("launch.nproc_per_node", "010", "nproc_per_node: '10'\n")):
        sec, name = key.split(".")
        rc, out = _run(["--config", _yaml(tmp_path, f"{sec}:\n  {name}: {text}\n")], {})
        assert rc == 0 and want in out, out
    # 020000 is 20000 bytes, as on the CLI -- not a multiple of 4096 -- never 8192
    rc, out = _run(["--config", _yaml(tmp_path, "recovery:\n  page_bytes: 020000\n")], {})
    assert rc == 2 and "20000 is not a positive multiple of 4096" in out


def test_a_yaml_1_1_only_number_is_refused_naming_the_key_and_the_fix(tmp_path):
    rc, out = _run(["--config", _yaml(tmp_path, "launch:\n  max_restarts: 1_0\n")], {})
    assert rc == 2 and "launch.max_restarts" in out and "'1_0' is not an integer" in out
    # an explicit tag takes decimal digits only (PyYAML read `!!int 0x10` as 16, `!!int 010` as 8)
    rc, out = _run(["--config", _yaml(tmp_path, "launch:\n  max_restarts: !!int 0x10\n")], {})
    assert rc == 2 and "launch.max_restarts" in out and "decimal digits" in out
    rc, out = _run(["--config", _yaml(tmp_path, "launch:\n  max_restarts: !!int 010\n")], {})
    assert rc == 0 and "max_restarts: 10\n" in out


# inject specs in mapping form vs the same fields in a --inject string
INJECT_FIELDS = [("kill", "rank=0:step=5", f) for f in ("rank", "step", "attempt", "gen")]
INJECT_FIELDS += [("kill", "rank=0", "after")]
INJECT_FIELDS += [("kill", "rank=0:step=5:at=rmu.update", f) for f in ("group", "chunk", "garbage")]
INJECT_FIELDS += [("pages", "rank=0:step=5:tier=1:at=rmu.update", f)
                  for f in sorted(set(KINDS["pages"].extra_keys) - {"tier"})]
INJECT_FIELDS += [("signal", "rank=0:step=5", "signal")]


@pytest.mark.parametrize("kind,base,field", INJECT_FIELDS, ids=lambda x: str(x))
def test_inject_mapping_fields_read_as_the_spec_string(tmp_path, kind, base, field):
    pairs = dict(p.split("=", 1) for p in base.split(":"))
    for text in TEXTS:
        fields = {**pairs, field: text}
        spec = ":".join([kind] + [f"{k}={v}" for k, v in fields.items()])
        if kind == "signal":
            spec = f"signal={fields['signal']}:" + ":".join(
                f"{k}={v}" for k, v in fields.items() if k != "signal")
        mapping = ", ".join([f"kind: {kind}"] + [f"{k}: {v}" for k, v in fields.items()])
        from_yaml = _run(["--config", _yaml(tmp_path, f"inject:\n  - {{{mapping}}}\n")], {})
        from_cli = _run(["--inject", spec], {})
        assert from_yaml[0] == from_cli[0], (spec, from_yaml, from_cli)
        if from_yaml[0] == 0:
            assert from_yaml[1] == from_cli[1], spec
        else:
            assert from_yaml[0] == 2 and _key(from_yaml[1]) == _key(from_cli[1]), spec


@pytest.mark.parametrize("body,cli_args", [
    # lists and mappings: their items are text too (the CLI passes text)
    ("launch:\n  training_script: x.py\n  script_args: [--epochs, 010, yes, 1_0, 0x10, 1.50]\n",
     ["x.py", "--epochs", "010", "yes", "1_0", "0x10", "1.50"]),
    ("rendezvous:\n  conf: {join_timeout: 0900, is_host: yes}\n",
     ["--rdzv-conf", "join_timeout=0900,is_host=yes", "x.py"]),
    ("launch:\n  nproc_per_node: 2\nlogs:\n  redirects: {00: 1, 01: 2}\n",
     ["--nproc-per-node", "2", "--redirects", "0:1,1:2", "x.py"]),   # a mapping prints normalized
    ("launch:\n  nproc_per_node: 2\nlogs:\n  local_ranks_filter: [00, 01]\n",
     ["--nproc-per-node", "2", "--local-ranks-filter", "00,01", "x.py"]),
    ("recovery:\n  page_bytes: 04096\n  data_pages: 010\n  chunk_pages: 02\n",
     ["--page-bytes", "04096", "--data-pages", "010", "--chunk-pages", "02", "x.py"]),
    ("launch:\n  nnodes: 1:2\n", ["--nnodes", "1:2", "x.py"]),   # base 60 in YAML 1.1: 62
])
def test_structured_values_read_as_the_cli_reads_them(tmp_path, body, cli_args):
    def run(args):
        r = CliRunner().invoke(cli, ["--print-config", *args], obj={"env": {}})
        return r.exit_code, re.sub(r"\n  id: \S+", "", r.stdout if r.exit_code == 0 else r.stderr)
    yaml_args = ["--config", _yaml(tmp_path, body)]
    from_yaml = run(yaml_args if "training_script" in body else [*yaml_args, "x.py"])
    from_cli = run(cli_args)
    assert from_yaml[0] == from_cli[0] == 0, (from_yaml, from_cli)
    assert from_yaml[1] == from_cli[1]


def test_an_explicit_int_tag_past_python_s_digit_limit_names_the_key(tmp_path):
    body = "launch:\n  nproc_per_node: !!int " + "9" * 5000 + "\n"
    rc, out = _run(["--config", _yaml(tmp_path, body)], {})
    assert rc == 2 and "launch.nproc_per_node" in out and "5000 digits" in out
