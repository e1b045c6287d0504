"""What acts on training: the control plane (the ranks' agreement on the controller's state), every command's actuator, step skipping and snapshots."""
