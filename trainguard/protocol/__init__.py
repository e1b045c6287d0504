"""What the agent, the controller and the dashboards share: the wire models, the command
vocabulary with its bounds, and the metric catalogue. Imports neither torch nor FastAPI."""
