"""trainguard: training-stability monitoring and control for large-model training.

Layers (each imports only the ones below it):

    trainguard.cli, trainguard.demo          operator CLI, the demo run, the demo webhook sink
    trainguard.dashboards                    Grafana dashboards and Prometheus/Alertmanager config as code
    trainer_agent        trainguard.service  the in-rank agent (torch) | the controller (FastAPI)
    trainguard.protocol                      wire models, command vocabulary, bounds, metric catalogue

``trainer_agent`` stays a top-level name: it is what a training script imports.
"""

__version__ = "0.1.0"
