"""The rollout data plane as pearlctl sees it: which workers may take requests, and a client that
keeps an episode on one worker, moves it elsewhere when that worker goes away, and tags every
completion with the weight version that produced it."""
