"""What every foreign-run reader shares: an empty run directory to write into, the config a log implies
(provenance) and writing the mapped records as a mechdiag run directory."""


from pathlib import Path

from mechdiag import config as C
from mechdiag.errors import UserError
from mechdiag.integrations.provenance import (
    INFERRED,
    Provenance,
    infer_from_logs,
    infer_reward_weights,
    observed_max_reward,
)
from mechdiag.run import RunDir, flatten_config, held


def fresh_run_dir(into) -> RunDir:
    rd = into if isinstance(into, RunDir) else RunDir(into, create=True)
    rd.path.mkdir(parents=True, exist_ok=True)
    if held(rd.path):
        raise UserError(f"{rd.path} already holds a run ({', '.join(held(rd.path))}); give an empty folder")
    return rd

def with_logged(cfg, prov: Provenance, metrics: list[dict], length_name: str, lr_name: str):
    """cfg with the values the logs show (prov's inferences) put in, so rules reason from them."""
    infer_from_logs(prov, metrics, length_name, lr_name)
    if "rewards.weights" not in prov.keys:
        got = infer_reward_weights(metrics)
        if got:
            prov.infer("rewards.weights", got[0], got[1])
    data = cfg.model_dump(mode="json")
    for key in ("max_completion_tokens", "learning_rate"):
        e = prov.keys.get(key)
        if e and e["how"] == INFERRED:
            data[key] = e["value"]
    w = prov.keys.get("rewards.weights")
    if w and isinstance(w["value"], dict):
        data.setdefault("rewards", {})["weights"] = w["value"]
    try:
        return C.from_dict(data)
    except UserError:
        return cfg


def finish_provenance(prov: Provenance, metrics: list[dict], batch_max_key: str | None) -> dict:
    w = prov.keys.get("rewards.weights", {}).get("value")
    names = sorted({k.split("/", 1)[1] for m in metrics for k in m if k.startswith("reward/")})
    if isinstance(w, list):  # GRPOConfig.reward_weights: in the order of the reward functions (log order unknown)
        w = dict(zip(names, w, strict=False)) if len(w) == len(names) else None
    value, evidence = observed_max_reward(metrics, w if isinstance(w, dict) else None, batch_max_key)
    prov.max_reward = {"value": value, "evidence": evidence}
    return prov.to_dict()



def write_foreign(into, by_step: dict, trainer: str, fields: dict, path: Path, config, rolls: dict,
                   length_name: str, lr_name: str, batch_max_key: str | None) -> RunDir:
    rd = fresh_run_dir(into)
    prov = Provenance(trainer, fields)
    metrics, evals, samples = [], [], []
    for step, (tr, ev) in sorted(by_step.items()):
        if tr:
            if step in rolls:
                for k, v in rolls[step][0].items():
                    tr.setdefault(k, v)
            metrics.append({"step": step, **tr})
        if ev:
            evals.append({"step": step, **ev})
    for step in sorted(rolls):
        samples += rolls[step][1]
    if config:
        cfg = config if isinstance(config, C.Config) else C.load(config)
        for k, v in flatten_config(cfg.model_dump(mode="json")).items():
            prov.read(k, v, "the config given")
        header = f"read from {trainer} log {path}; the design is the config given"
    else:
        which = "kl_loss_coef" if any("kl_loss_coef" in m for m in metrics) else "kl_coef"
        coefs = [m[which] for m in metrics if which in m]
        if coefs:
            prov.read("beta", coefs[-1], "the logged kl coefficient (last step)")
            if trainer == "verl" and which == "kl_coef":  # PPO's KL in the reward, not the actor's KL loss
                prov.fields["beta"] = "algorithm.kl_ctrl.kl_coef"
        cfg = with_logged(C.from_dict({"beta": coefs[-1]} if coefs and 0 <= coefs[-1] else {}), prov, metrics,
                           length_name, lr_name)
        header = (f"read from {trainer} log {path}; the log holds no config: inferred and unknown values in "
                  "summary.json provenance (unknown ones are placeholders, never the run's)")
    C.save(cfg, rd.config_path, header=header)
    rd.append("metrics", metrics)
    rd.append("eval", evals)
    rd.append("samples", samples)
    summary = {"source": trainer, "verl_metrics": str(path), "steps": metrics[-1]["step"] if metrics else 0,
               "provenance": finish_provenance(prov, metrics, batch_max_key)}
    if evals and "accuracy" in evals[-1]:
        summary["final_accuracy"] = evals[-1]["accuracy"]
    rd.write_summary(summary)
    return rd
