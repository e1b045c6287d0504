"""The report step: the ranks' exchange, the report built on the device and copied to the host, the cross-rank work, /metrics and the controller client."""
