"""How ranks agree on one call: who they are, where they meet, who leads, what followers verify.

- :mod:`.identity`: job, node and process identity, and liveness, decided in one place;
- :mod:`.store`: the job-wide key-value store the ranks meet in;
- :mod:`.key`: call identity: the arguments that decide a call's result, rendered safely;
- :mod:`.protocol`: claim, lead, follow, attempts, heartbeats and follower bookkeeping;
- :mod:`.rank0`: what rank 0 publishes (its calls, whether it is blocked) so that it leads;
- :mod:`.scope`: which ranks share a download (node or job);
- :mod:`.call`: one coordinated call of a patched function, with the leader's pins and the
  followers' verification.
"""
