"""The browser views: the coordinator's dashboard and a node's own status page.

* :mod:`swarm.web.server` -- :class:`ReadOnlyHttpServer`: GET/HEAD only, a route table of JSON
                             (or other) answers, the packaged static files, security headers
                             (a strict Content-Security-Policy: scripts only from this server)
* ``static/``             -- the pages (``dashboard.html``/``.js``, ``node.html``/``.js``), the
                             shared ``common.js``/``style.css``, and uPlot (vendored from npm
                             ``uplot@1.6.32``, MIT, ``uPlot.LICENSE``): no CDN, no build step

The pages draw everything from the JSON endpoints of the process that serves them and never turn
data into markup: every value is set with ``textContent``, so a node that names its GPU
``<script>`` only shows that text. Nothing is imported here, so ``swarm --help`` stays fast.
"""
