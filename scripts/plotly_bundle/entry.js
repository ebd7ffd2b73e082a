// kvlab's Plotly: the core (which holds the scatter trace) with the bar and heatmap traces, the only traces kvlab's
// 2D charts draw. Built by build.sh into static/; see that script for why.
var Plotly = require("plotly.js/lib/core");

Plotly.register([require("plotly.js/lib/bar"), require("plotly.js/lib/heatmap")]);

window.Plotly = Plotly;
