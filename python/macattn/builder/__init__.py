"""Builder: model patching, graph export, engine building."""
