"""One kernel protocol per kind of layer work (see `atlas.ports.gpu.Kind`)."""
