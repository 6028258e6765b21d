"""Report sections: reports/sections/<analyzer NAME>.py renders that analyzer's metrics."""
