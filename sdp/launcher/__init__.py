"""``sdprun``: start N worker processes with the sdp environment (like horovodrun / kungfu-run)."""
