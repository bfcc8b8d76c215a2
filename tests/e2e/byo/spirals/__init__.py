"""A model and dataset that exist nowhere in Ravnest: the e2e tier trains them from a user image
(tests/e2e/byo/Dockerfile) to prove a job's own code runs in its own pods."""
